"""The `tfdist` command answers bad arguments before TensorFlow is imported, and keeps TensorFlow's start-up
lines out of its output unless asked (`tfdist --verbose`, TF_CPP_MIN_LOG_LEVEL).

The subprocess checks look at which modules were imported, never at wall time (a shared machine is noisy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tfdist.cli.names import DATASET_NAMES, STRATEGY_NAMES
from tfdist.tf_logs import kept_lines

# What a fresh process imports is the point here: no fork of the suite's pre-imported zygote.
pytestmark = pytest.mark.usefixtures("fresh_processes")

REPO = Path(__file__).resolve().parents[1]
NOT_A_MODEL, A_DIRECTORY = str(REPO / "README.md"), str(REPO / "docs")

# Runs tfdist's main() with the arguments after `--`; prints {"code", "heavy", "level"} as the last stdout line.
WRAPPER = textwrap.dedent("""
    import json, sys
    from tfdist.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit:
        code = exit.code
    import os
    heavy = sorted(m for m in ("tensorflow", "keras") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy, "level": os.environ.get("TF_CPP_MIN_LOG_LEVEL")}))
""")


def env_without_log_level(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # conftest sets it for every test
    return {**env, **extra}


def run_main(*args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *args], check=False, capture_output=True, text=True,
                          timeout=120, env=env or env_without_log_level())
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_cli_name_tables_equal_the_library_tables():
    import tfdist
    from tfdist.strategies import factory

    assert list(STRATEGY_NAMES) == factory.strategy_names()  # sorted, as strategy_names() gives them
    assert set(STRATEGY_NAMES) == set(factory.CLASSES) | {"default"}
    assert DATASET_NAMES == tuple(tfdist.data.DATASET_NAMES)


@pytest.mark.parametrize("args, message", [
    (["train", "--strategy", "bogus"], "tfdist train: error: argument --strategy: invalid choice: 'bogus'"),
    (["train", "--dataset", "cifar10"], "tfdist train: error: argument --dataset: invalid choice: 'cifar10'"),
    (["train", "--zero-stage", "4"], "argument --zero-stage: invalid choice: 4"),
    (["train", "--epochs", "0"], "tfdist train: error: --epochs must be >= 1"),
    (["train", "--strategy", "placement", "--zero-stage", "1"], "--zero-stage 1 is supported by --strategy"),
    (["train", "--replicas", "0"], "tfdist train: error: --replicas must be >= 1"),
    (["train", "--batch-size", "0"], "tfdist train: error: --batch-size must be >= 1, got 0."),
    (["train", "--batch-size", "63", "--replicas", "4"], "--batch-size 63 does not split evenly over --replicas 4"),
    (["train", "--learning-rate", "-1"], "tfdist train: error: --learning-rate must be a positive number, got -1.0."),
    (["train", "--learning-rate", "nan"], "--learning-rate must be a positive number, got nan."),
    (["cluster", "--ps", "-1"], "tfdist cluster: error: --ps must be >= 0 (the number of parameter servers), got -1."),
    (["plan", "--params", "25x", "--replicas", "2"],
     "tfdist plan: error: argument --params: expected a count such as 25M, 1.3B or 125000000, got '25x'."),
    (["plan", "--params", "0", "--replicas", "2"], "argument --params: must be at least 1, got '0'."),
    (["plan", "--params", "1M", "--replicas", "0"], "tfdist plan: error: --replicas must be >= 1, got 0."),
    (["plan", "--params", "1M", "--replicas", "2", "--device-memory", "0"], "--device-memory must be > 0 GB"),
    (["plan", "--model", "no-such-model.keras", "--replicas", "2"], "--model: no file 'no-such-model.keras'"),
    (["plan", "--model", NOT_A_MODEL, "--devices", "2"], "is not a Keras model file (a .keras archive"),
    (["plan", "--model", A_DIRECTORY, "--devices", "2"], "is a directory (a SavedModel?); give a .keras file"),
    (["plan", "--model", NOT_A_MODEL, "--devices", "0"], "argument --devices: must be at least 1, got '0'."),
    (["plan", "--model", NOT_A_MODEL, "--devices", "-4"], "argument --devices: must be at least 1, got '-4'."),
    (["plan", "--model", NOT_A_MODEL, "--devices", "2", "--device-memory", "-1"], "--device-memory must be > 0"),
    (["plan", "--params", "1M", "--replicas", "2", "--device-memory", "nan"], "--device-memory must be > 0 GB, got"),
    (["plan", "--params", "1M", "--devices", "2"], "--devices needs --model (a .keras file)"),
    (["plan", "--model", NOT_A_MODEL, "--devices", "2", "--replicas", "2"], "leave out --replicas"),
    (["plan", "--model", NOT_A_MODEL, "--devices", "2", "--batch-size", "0"], "argument --batch-size: must be"),
    (["launch", "-n", "2", "--backend", "nccl", "--", "true"], "argument --backend: invalid choice: 'nccl'"),
])
def test_bad_arguments_exit_2_before_tensorflow_is_imported(args, message):
    result, stderr = run_main(*args)
    assert result["code"] == 2, stderr
    assert message in stderr, stderr
    assert result["heavy"] == [], f"{args} imported {result['heavy']} before refusing its arguments"
    assert "Traceback" not in stderr


def test_the_entry_point_refuses_a_bad_strategy_without_importing_tensorflow():
    """`python -m tfdist`, the path of the installed command; -X importtime lists every module imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tfdist", "train", "--strategy", "bogus"],
                          check=False, capture_output=True, text=True, timeout=120, env=env_without_log_level())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "argument --strategy: invalid choice: 'bogus'" in proc.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "tfdist.cli" in imported  # the check below looks at a real list
    assert not {"tensorflow", "keras"} & imported


@pytest.mark.parametrize("args, env, level", [
    ([], {}, "2"),                                   # quiet by default
    ([], {"TF_CPP_MIN_LOG_LEVEL": "0"}, "0"),        # the user's setting wins
    (["--verbose"], {}, None),                       # --verbose: TensorFlow's own default (everything)
])
def test_tensorflow_log_level_default_user_setting_and_verbose(args, env, level):
    # --epochs 0 passes argparse and fails in the command's own checks: main() has set the level by then.
    result, stderr = run_main(*args, "train", "--epochs", "0", env=env_without_log_level(**env))
    assert result["code"] == 2 and "--epochs must be >= 1" in stderr
    assert result["level"] == level


def test_kept_lines_drops_absl_lines_below_the_level():
    banner = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    info = "I0000 00:00:1795941548.960993    1922 port.cc:153] oneDNN custom operations are on.\n"
    warning = "W0000 00:00:1795941548.960993    1922 some.cc:12] a warning\n"
    error = "E0000 00:00:1795941548.960993    1922 some.cc:13] an error\n"
    own = "DeprecationWarning: something Python said\n"
    text = banner + info + warning + error + own
    assert kept_lines(text, 0) == text
    assert kept_lines(text, 1) == warning + error + own
    assert kept_lines(text, 2) == error + own
    assert kept_lines(text, 3) == own


def test_a_command_that_starts_tensorflow_shows_none_of_its_start_up_lines():
    """What a plain `import tensorflow` writes to stderr here (oneDNN, CPU features: it depends on the machine)
    is hidden by `tfdist plan`, and shown again by `tfdist --verbose plan`."""
    env = env_without_log_level()
    plain = subprocess.run([sys.executable, "-c", "import tensorflow"], check=False, capture_output=True, text=True,
                           timeout=120, env=env).stderr
    quiet = subprocess.run([sys.executable, "-m", "tfdist", "plan", "--params", "1M", "--replicas", "2"],
                           check=False, capture_output=True, text=True, timeout=120, env=env)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "ZeRO-3" in quiet.stdout
    assert "InitializeLog" not in quiet.stderr, quiet.stderr
    assert not re.search(r"^[IW]\d{4} ", quiet.stderr, re.MULTILINE), quiet.stderr
    verbose = subprocess.run([sys.executable, "-m", "tfdist", "--verbose", "plan", "--params", "1M", "--replicas",
                              "2"], check=False, capture_output=True, text=True, timeout=120, env=env)
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    if "port.cc" in plain:  # oneDNN's notice, where this TensorFlow prints it
        assert "port.cc" in verbose.stderr


def _parsers(parser) -> dict:
    """{command: [parsers]}: each command's parser, and a command's own sub-commands (tfdist bench NAME)."""
    import argparse

    def subs(p):
        return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})

    return {name: [p, *subs(p).values()] for name, p in subs(parser).items()}


def test_every_option_of_every_command_is_in_the_cli_guide_and_the_guide_names_no_other():
    """docs/cli.md has a section per command (## `tfdist NAME`): it names each option of that command (one
    spelling of it), and every --option it names exists there (for `bench`, in one of its benchmarks)."""
    from tfdist.cli import build_parser

    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## `tfdist ([\w-]+)`[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    problems = []
    every = _parsers(build_parser())
    for command, parsers in every.items():
        section = sections.get(command)
        if section is None:
            problems.append(f"no section '## `tfdist {command}`'")
            continue
        own = [a for a in parsers[0]._actions if a.option_strings and a.dest != "help"]
        for action in own:
            if not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", section) for o in action.option_strings):
                problems.append(f"tfdist {command}: {'/'.join(action.option_strings)} is not in its section")
        for line in section.splitlines():
            # a line may show another command too (`tfdist launch -n 2 -- tfdist train --strategy ps`)
            shown = {command, *re.findall(r"tfdist ([\w-]+)", line)} & set(every)
            known = {o for name in shown for p in every[name] for a in p._actions for o in a.option_strings}
            for named in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line):
                if named not in known and named != "--help":
                    problems.append(f"tfdist {command}: the guide names {named}, which the command does not take: "
                                    f"{line.strip()[:100]}")
    assert not problems, "docs/cli.md against argparse:\n" + "\n".join(problems)


def test_build_compiles_one_job_per_core_unless_told_otherwise(monkeypatch):
    from tfdist.cli.build_horovod import build_jobs

    monkeypatch.setattr("os.cpu_count", lambda: 6)
    # `make test` hands its own MAKEFLAGS down (no job count): Horovod would then compile one file at a time
    assert build_jobs("w -- VERBOSE=1 PYTEST_ARGS=-rfEs\\ --durations=0") == "-j6"
    assert build_jobs("") == "-j6"
    assert build_jobs(" -j3 --jobserver-auth=3,4") == "-j3" and build_jobs("--jobs=5") == "-j5"

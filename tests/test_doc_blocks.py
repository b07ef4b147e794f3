"""Docs that stay true: every fenced Python block of README.md and docs/*.md runs, every `tfdist ...` command
shown parses, and every full constructor signature written in the docs is the constructor's.

How blocks run (one epoch, a page's blocks in order in a namespace of their own, pages sharing a process, `run with:`
scripts launched): tests/doc_blocks.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import doc_blocks
import pytest

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}  # PYTHONPATH: conftest's (this clone, tests/site)
VIRTUAL_CPUS = re.compile(r"virtual_cpus\((\d+)\)")

# Runs pages one after another in one process (TensorFlow started once, with the logical CPUs they all ask for):
# each page's blocks in order in a namespace of its own and a working directory of its own, then Keras' global
# state (session, dtype policy, distribution) back to its defaults. A failing block is named by its page and line.
DRIVER = textwrap.dedent("""
    import json, os, sys, tempfile, traceback
    runs, results = json.load(open(sys.argv[1])), {}
    for key, blocks in runs:
        os.chdir(tempfile.mkdtemp(prefix="page-", dir=sys.argv[3]))
        namespace = {"__name__": "__main__"}
        try:
            for label, code in blocks:
                print(f"--- {label}", flush=True)
                exec(compile(code, label, "exec"), namespace)
            results[key] = None
        except BaseException:
            results[key] = traceback.format_exc()
        finally:
            if "keras" in sys.modules:
                import keras
                keras.backend.clear_session()
                keras.config.set_dtype_policy("float32")
                keras.distribution.set_distribution(None)
        json.dump(results, open(sys.argv[2], "w"))
""")


def in_process_runs() -> list[tuple[str, int | None, list[doc_blocks.Block]]]:
    """A page's in-process blocks, cut where a block asks for another number of logical CPUs than its process
    started TensorFlow with (fixed at start): (key, logical CPUs, blocks) per run."""
    runs: dict[str, list] = {}
    for block in doc_blocks.python_blocks():
        if block.launch or block.not_run:
            continue
        wanted = VIRTUAL_CPUS.search(block.code)
        key = block.page
        current = [r for r in runs if r.split("@")[0] == block.page]
        if current:
            key = current[-1]
            cpus = runs[key][0]
            # TensorFlow started in that process with `cpus` logical CPUs (None: its default, one)
            if wanted and int(wanted.group(1)) != cpus:
                key = f"{block.page}@{block.line}"
        entry = runs.setdefault(key, [int(wanted.group(1)) if wanted else None, []])
        if entry[0] is None and wanted:
            entry[0] = int(wanted.group(1))
        entry[1].append(block)
    return [(key, entry[0], entry[1]) for key, entry in runs.items()]


def launched(collective_library: str, *, repeats: bool = False) -> list[doc_blocks.Block]:
    """The `run with:` blocks whose launch uses `collective_library` ("tf" or "horovod"); a script repeated
    line for line on another page (README and its guide) runs once unless `repeats`."""
    seen, found = set(), []
    for b in doc_blocks.python_blocks():
        if not b.launch or b.not_run:
            continue
        backend = b.launch[b.launch.index("--backend") + 1] if "--backend" in b.launch else "tf"
        body = [line.rstrip() for line in doc_blocks.for_the_suite(b.code).splitlines()[1:] if line.strip()]
        key = ("\n".join(body), tuple(b.launch[:b.launch.index("--")]))  # the header comment and blank lines aside
        if backend == collective_library and (repeats or key not in seen):
            found.append(b)
        seen.add(key)
    return found


def run_launched(block: doc_blocks.Block, tmp_path) -> None:
    (tmp_path / "train.py").write_text(doc_blocks.for_the_suite(block.code))
    argv = block.launch[1:]
    inner = argv.index("--")
    cmd = [sys.executable, "-m", "tfdist", *argv[:inner + 1], sys.executable, *argv[inner + 2:]]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{block.label}: {' '.join(block.launch)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"


RUNS = in_process_runs()
# Strategies that must be created before TensorFlow initialises: a run that makes one has a process of its own.
FIRST_THING = re.compile(r"\b(MultiWorkerMirroredStrategy|HorovodStrategy|ParameterServerStrategy)\(")
# Runs share a process when TensorFlow starts them with the same logical CPUs (None: TF's default, one).
PROCESS = {key: key if any(FIRST_THING.search(b.code) for b in run) else f"cpus={cpus}" for key, cpus, run in RUNS}


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Each group of runs (see PROCESS) in one fresh process, started when a test first asks for it."""
    done: dict[str, dict] = {}

    def result(key: str) -> tuple[str | None, str]:
        process = PROCESS[key]
        if process not in done:
            tmp = tmp_path_factory.mktemp("pages")
            group = [(k, [(b.label, doc_blocks.for_the_suite(b.code)) for b in run]) for k, _, run in RUNS
                     if PROCESS[k] == process]
            (tmp / "runs.json").write_text(json.dumps(group))
            proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp / "runs.json"), str(tmp / "results.json"),
                                   str(tmp)], cwd=tmp, env=ENV, capture_output=True, text=True, timeout=1200,
                                  check=False)
            results = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").exists() else {}
            done[process] = {"results": results, "output": proc.stdout[-3000:] + proc.stderr[-4000:]}
        group = done[process]
        if key not in group["results"]:  # the process died before this page (its output says why)
            return f"the pages' process ended before {key}", group["output"]
        return group["results"][key], group["output"]

    return result


@pytest.mark.slow
@pytest.mark.parametrize("key", list(PROCESS))
def test_a_pages_python_blocks_run_in_order(key, page_results):
    error, output = page_results(key)
    assert error is None, f"{key}\n{error}\n--- the process's output:\n{output}"


@pytest.mark.slow
@pytest.mark.parametrize("block", launched("tf"), ids=lambda b: b.label)
def test_a_launched_block_trains(block, tmp_path):
    run_launched(block, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block", launched("horovod"), ids=lambda b: b.label)
def test_a_launched_horovod_block_trains(block, tmp_path):
    run_launched(block, tmp_path)


def test_every_block_is_run_or_says_why_not():
    blocks = doc_blocks.python_blocks()
    assert len(blocks) > 40, "the block finder found too few Python blocks: check doc_blocks.FENCE"
    for block in blocks:
        if block.not_run:
            assert len(block.not_run) > 10, f"{block.label}: say why the block is not run"
    ran = {b.label for _, _, run in RUNS for b in run}
    ran |= {b.label for b in launched("tf", repeats=True) + launched("horovod", repeats=True)}
    missing = [b.label for b in blocks if not b.not_run and b.label not in ran]
    assert not missing, f"blocks neither run nor marked '<!-- not run: reason -->': {missing}"


COMMANDS = doc_blocks.tfdist_commands()


def test_every_tfdist_command_in_the_docs_parses():
    from tfdist.cli import build_parser

    assert len(COMMANDS) > 30
    bad = []
    for where, argv in COMMANDS:
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit:
            if exit.code:
                bad.append(f"{where}: tfdist {' '.join(argv)}")
    assert not bad, "commands in the docs that `tfdist` refuses:\n" + "\n".join(bad)


SIGNATURE = re.compile(r"`tfdist\.((?:\w+\.)*[A-Z]\w+)\(([^`]*=[^`]*)\)`")


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(["tfdist", *parts[:cut - 1]]))
        except ImportError:
            continue
        for part in parts[cut - 1:]:
            obj = getattr(obj, part)
        return obj
    raise AttributeError(dotted)


def _same(written: str, actual) -> bool:
    import ast

    try:
        return ast.literal_eval(written) == actual
    except (ValueError, SyntaxError):
        return written == repr(actual)


def _written_arguments(args: str) -> list[tuple[str, str | None]]:
    pieces = [a.strip() for a in re.split(r",\s*(?![^()\[\]]*[)\]])", args)]
    return [tuple(a.split("=", 1)) if "=" in a else (a, None) for a in pieces if a and a not in ("*", "...")]


def test_constructor_calls_and_signatures_written_in_the_docs_are_the_real_ones():
    """`tfdist.X(...)` in inline code: every keyword written is a parameter of X. When it starts with X's first
    parameter and names at least three (a signature, as the guides write them), the names are X's parameters in
    order, with X's defaults."""
    signatures, calls, wrong = 0, 0, []
    for page in doc_blocks.markdown_pages():
        text = re.sub(r"\s*\n\s*", " ", page.read_text(encoding="utf-8"))  # signatures wrap across lines
        for name, args in SIGNATURE.findall(text):
            params = inspect.signature(_resolve(name)).parameters
            real = [(p.name, p.default) for p in params.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            written = _written_arguments(args)
            calls += 1
            unknown = [n for n, d in written if d is not None and n not in params and not takes_any]
            if unknown:
                wrong.append(f"{page.name}: tfdist.{name}(... {', '.join(unknown)} ...): no such parameter; it has "
                             f"({', '.join(n for n, _ in real)})")
            if len(written) < 3 or not real or written[0][0] != real[0][0]:
                continue
            signatures += 1
            names, real_names = [n for n, _ in written], [n for n, _ in real]
            elided = "..." in args  # "a=1, ..., z=2": the names written are in the signature, in its order
            in_order = ([n for n in real_names if n in names] == names) if elided else names == real_names
            if not in_order:
                wrong.append(f"{page.name}: tfdist.{name}({', '.join(names)}{', ...' if elided else ''}) but the "
                             f"signature is ({', '.join(real_names)})")
                continue
            defaults = dict(real)
            for n, default in written:
                actual = defaults[n]
                if default is not None and actual is not inspect.Parameter.empty and not _same(default, actual):
                    wrong.append(f"{page.name}: tfdist.{name}: {n}={default}, but the default is {actual!r}")
    assert calls >= 10 and signatures >= 3, f"found {calls} calls, {signatures} signatures: check SIGNATURE"
    assert not wrong, "\n".join(wrong)

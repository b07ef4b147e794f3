"""docs/troubleshooting.md and the errors that point to it: every anchor an error message names exists on the page,
every runtime-situation error tfdist constructs carries a link, and the page has an entry per situation.

Fast and TensorFlow-free: it reads tfdist/ as source text (ast) and calls only message builders that need no
TensorFlow.
"""

from __future__ import annotations

import ast
import re
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tfdist"
DOCS = REPO / "docs"
PAGE = DOCS / "troubleshooting.md"

# The situations the page must cover (issue: the errors users meet), by the anchor of their entry.
REQUIRED_ENTRIES = {
    "initordererror": "TensorFlow started before the strategy or virtual_cpus",
    "mixing-different-tfdistributestrategy-objects": "model or optimizer made outside the strategy's scope",
    "a-peer-never-starts": "a worker listed in TF_CONFIG never comes",
    "a-collective-times-out": "collective timeouts",
    "a-worker-was-lost": "a lost or stopped worker (TF collectives and Horovod)",
    "the-launcher-stopped-the-job": "a worker that exits, --max-restarts",
    "port-already-in-use": "ports in use",
    "horovod-is-missing-or-does-not-build": "Horovod build failures",
    "gloo-timeouts": "HOROVOD_GLOO_TIMEOUT_SECONDS",
    "out-of-memory-while-creating-a-zero-3-model": "OOM at model creation under ZeRO-3",
    "nan-losses-under-float16": "NaNs under fp16",
    "a-parameter-server-was-lost": "a lost parameter server",
    "datasets-of-different-lengths-per-worker": "uneven data",
}
# The entries tfdist's own messages link to (the others explain TensorFlow's, Keras' and Horovod's messages).
LINKED_ANCHORS = {"initordererror", "a-peer-never-starts", "port-already-in-use", "a-collective-times-out",
                  "a-worker-was-lost", "a-parameter-server-was-lost", "horovod-is-missing-or-does-not-build",
                  "the-launcher-stopped-the-job", "a-node-does-not-join---nnodes"}
# Exceptions about a runtime situation: every construction in tfdist/ must end with troubleshooting(...).
LINKED_ERRORS = ("InitOrderError", "WorkerLostError", "ParameterServerLost", "CollectiveError", "BuildError")
# Phrases the page quotes from tfdist's messages: the page and the code must keep saying the same.
QUOTED = (
    "before TensorFlow initialises", "TensorFlow is already initialised with", "could not form the cluster of",
    "not answering after connect_timeout_s", "is probably in use by another process", "The job cannot continue",
    "it stopped answering (stopped, hung or unreachable)", "the coordination leader",
    "a parameter server stopped answering", "Horovod is not installed in this Python",
    "was created outside the strategy's scope", "a process that stopped or skipped a call",
    "building the Horovod", "does not list", "no restart left", "is stopped (SIGSTOP or SIGTSTP",
    "parameter servers are not restarted",
)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, inline-code backticks and punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        match = None if fenced else re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            found.add(github_anchor(match.group(1)))
    return found


def sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def called_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def linked_anchors(node: ast.AST) -> list[str]:
    """The string constants given to troubleshooting(...) calls inside `node` (both branches of a conditional)."""
    calls = [call for call in ast.walk(node) if isinstance(call, ast.Call) and called_name(call) == "troubleshooting"]
    return [const.value for call in calls for arg in call.args for const in ast.walk(arg)
            if isinstance(const, ast.Constant) and isinstance(const.value, str)]


def test_github_anchor_rules():
    assert github_anchor("Mixing different tf.distribute.Strategy objects") == \
        "mixing-different-tfdistributestrategy-objects"
    assert github_anchor("Restarts: `--max-restarts`") == "restarts---max-restarts"
    assert github_anchor("Out of memory while creating a ZeRO-3 model") == "out-of-memory-while-creating-a-zero-3-model"


def test_the_helper_names_the_page_and_the_anchor():
    from tfdist.errors import TROUBLESHOOTING_PAGE, troubleshooting

    assert (REPO / TROUBLESHOOTING_PAGE) == PAGE and PAGE.is_file()
    assert troubleshooting("a-worker-was-lost") == " See docs/troubleshooting.md#a-worker-was-lost."


def test_every_anchor_tfdist_links_to_exists_on_the_page():
    on_page = anchors(PAGE)
    used = {(path.relative_to(REPO), anchor) for path, tree in sources().items() for anchor in linked_anchors(tree)}
    assert LINKED_ANCHORS <= {anchor for _, anchor in used}, used  # the links exist at all
    missing = sorted(f"{path}: #{anchor}" for path, anchor in used if anchor not in on_page)
    assert not missing, "troubleshooting(...) anchors without a heading in the page:\n" + "\n".join(missing)


def test_every_runtime_error_tfdist_constructs_carries_a_link():
    constructions, unlinked = [], []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and called_name(node) in LINKED_ERRORS:
                constructions.append(node)
                if not linked_anchors(node):
                    unlinked.append(f"{path.relative_to(REPO)}:{node.lineno}: {called_name(node)}(...)")
    names = {called_name(node) for node in constructions}
    assert {"InitOrderError", "WorkerLostError", "ParameterServerLost", "CollectiveError"} <= names, names
    assert not unlinked, "runtime errors without troubleshooting(...):\n" + "\n".join(unlinked)


@pytest.mark.parametrize("module, function", [
    ("tfdist/comm/peers.py", "startup_error"),                       # a peer never starts, a port in use
    ("tfdist/strategies/parameter_server.py", "_wait_for_tasks"),    # a parameter server or worker never starts
    ("tfdist/cli/build_horovod.py", "_check_tools"),                 # Horovod cannot build
    ("tfdist/cli/build_horovod.py", "build_wheel"),
])
def test_runtime_config_errors_carry_a_link(module, function):
    tree = ast.parse((REPO / module).read_text(encoding="utf-8"))
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    assert linked_anchors(node), f"{module}: {function} raises without troubleshooting(...)"


def test_the_horovod_install_hint_carries_a_link():
    tree = ast.parse((PACKAGE / "comm" / "horovod.py").read_text(encoding="utf-8"))
    (hint,) = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "INSTALL_HINT" for t in n.targets)]
    assert linked_anchors(hint) == ["horovod-is-missing-or-does-not-build"]


def test_the_page_has_an_entry_per_situation():
    on_page = anchors(PAGE)
    missing = [f"#{anchor} ({what})" for anchor, what in REQUIRED_ENTRIES.items() if anchor not in on_page]
    assert not missing, "docs/troubleshooting.md lacks entries:\n" + "\n".join(missing)
    text = PAGE.read_text(encoding="utf-8")
    assert "uneven-data.md" in text and "keras.optimizers.LossScaleOptimizer" in text


def test_the_page_quotes_what_the_code_says():
    page = PAGE.read_text(encoding="utf-8")
    code = "\n".join(path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py"))
    for phrase in QUOTED:
        assert phrase in page, f"docs/troubleshooting.md no longer quotes {phrase!r}"
        assert phrase in code, f"{phrase!r} is quoted in docs/troubleshooting.md but no message in tfdist/ says it"


def test_the_links_on_the_page_resolve():
    text = PAGE.read_text(encoding="utf-8")
    own = anchors(PAGE)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = PAGE if not file_part else (DOCS / file_part)
        if not path.is_file():
            broken.append(target)
        elif anchor and anchor not in (own if path == PAGE else anchors(path)):
            broken.append(target)
    # The quoted messages name the page too: their anchors must exist.
    broken += [f"#{a}" for a in re.findall(r"See docs/troubleshooting\.md#([\w-]+)\.", text) if a not in own]
    assert not broken, f"docs/troubleshooting.md: broken links {broken}"


def test_the_page_has_no_dates_or_issue_numbers_of_ours():
    text = PAGE.read_text(encoding="utf-8")
    assert not re.search(r"\b\d{4}-\d{2}-\d{2}\b", text)
    assert not re.search(r"(?<![\w/])(issue\s*)?#\d+\b", text, re.IGNORECASE)  # upstream ones read keras#20585


def test_startup_errors_point_to_the_peer_or_the_port_entry():
    from tfdist.comm.peers import startup_error
    from tfdist.comm.tf_config import parse_tf_config

    config = parse_tf_config({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                              "task": {"type": "worker", "index": 1}})
    silent = str(startup_error(config, 5, None, missing=["localhost:1"]))
    assert "could not form the cluster of 2 workers within timeout_s=5 s" in silent
    assert silent.endswith("See docs/troubleshooting.md#a-peer-never-starts.")
    taken = str(startup_error(config, 5, RuntimeError("Could not start gRPC server"), missing=[]))
    assert "This worker's own port (localhost:2) is probably in use by another process. " \
           "See docs/troubleshooting.md#port-already-in-use. TensorFlow said: Could not start gRPC server" in taken


def test_a_lost_horovod_rank_is_named_with_the_link(monkeypatch):
    from tfdist.comm import horovod_peers

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing accepts there: the rank "exited"
    peers = (horovod_peers.Peer(0, "here", 1, "127.0.0.1:9"), horovod_peers.Peer(1, "there", 4243, address))
    monkeypatch.setitem(horovod_peers._STATE, "rank", 0)
    monkeypatch.setitem(horovod_peers._STATE, "peers", peers)
    err = horovod_peers.lost_rank_error(RuntimeError("Horovod has been shut down"))
    assert str(err).startswith("rank 0 lost rank 1 (host there, pid 4243): it exited (Horovod has been shut down)")
    assert str(err).endswith("See docs/troubleshooting.md#a-worker-was-lost.")


def test_a_horovod_source_this_build_cannot_patch_is_a_build_error_with_the_link(tmp_path):
    from tfdist.cli.build_horovod import BuildError, patch_source
    from tfdist.errors import TfdistError

    cmake = tmp_path / "horovod" / "tensorflow" / "CMakeLists.txt"
    cmake.parent.mkdir(parents=True)
    cmake.write_text("set(XLA_OPS xla_mpi_ops)\n")
    with pytest.raises(BuildError, match="horovod-is-missing-or-does-not-build") as caught:
        patch_source(str(tmp_path))
    assert isinstance(caught.value, TfdistError) and isinstance(caught.value, RuntimeError)
    assert "xla_mpi_ops.cc is referenced in a form this fix does not know" in str(caught.value)


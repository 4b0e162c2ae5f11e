"""Shared fixtures.

Triton's interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must
be set before anything imports triton: here, at conftest import. On a machine with
CUDA it is left alone so that GPU tests run the compiled kernels.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# one intra-op thread per xdist worker: the workers already fill the cores, and two workers
# each running torch's default of one thread per core oversubscribe them (a model of many small
# ops, Qwen3-Next's chunked delta rule, ran 15x slower next to another worker)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from normfuse.zoo import prepare_torchvision  # noqa: E402

# transformers imports torchvision whenever it is installed; a torchvision wheel whose C
# extension does not load (the CUDA build next to a CPU torch) imports only after this
prepare_torchvision()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def triton_cpu(monkeypatch):
    """Run the fused ops' Triton kernels on CPU tensors, under Triton's interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(GPU_HERE_REASON)
    monkeypatch.setenv("NORMFUSE_TRITON_CPU", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---- CI: a missing dependency or a skip nobody allowed fails the run -----------------------
#
# With CI=true, the run fails (1) at its start when a distribution the dev install declares
# (pyproject.toml: [project] dependencies and the dev extra, its normfuse[...] extras followed)
# is not installed: a broken install would otherwise turn whole modules into skips; and (2) at
# its end when a test that does not need a GPU skipped and is not on the list below. Skip
# reasons are printed by `make test` (pytest -rs); outside CI unexpected skips are listed only.

GPU_SKIP_REASON = "needs a CUDA device"
# on a machine with a GPU the interpreter's tests skip: the kernels are compiled for it there
GPU_HERE_REASON = "Triton kernels are compiled for the GPU here (TRITON_INTERPRET is not 1)"

# node id (fnmatch pattern) -> why it may skip on CI, where it skips. Remove a line when its
# reason goes away.
SKIPS_ALLOWED_ON_CI: dict[str, str] = {
    # empty: every non-GPU test runs on CI (x-transformers, diffusers and torchao are in the dev extra)
}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def declared_distributions() -> set[str]:
    """The distributions the dev install declares (pyproject.toml), normfuse's own extras followed."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    todo, names, seen = [*project.get("dependencies", []), *extras.get("dev", [])], set(), {"dev"}
    while todo:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", todo.pop())
        name, wanted = match.group(1), match.group(2)
        if name.lower() != "normfuse":
            names.add(name)
            continue
        for extra in (e.strip() for e in (wanted or "").split(",")):
            if extra and extra not in seen:
                seen.add(extra)
                todo += extras.get(extra, [])
    return names


def missing_distributions() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    missing = []
    for name in sorted(declared_distributions()):
        try:
            version(name)
        except PackageNotFoundError:
            missing.append(name)
    return missing


def pytest_sessionstart(session):
    if _in_ci() and getattr(session.config, "workerinput", None) is None:
        missing = missing_distributions()
        if missing:
            pytest.exit(f"CI: declared dependencies not installed: {', '.join(missing)} "
                        f"(pip install -e '.[dev]'); their tests would only skip", returncode=1)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def unexpected_skips(stats) -> list[tuple[str, str]]:
    """(node id, reason) of each skip that neither needs a GPU nor is on SKIPS_ALLOWED_ON_CI."""
    import fnmatch

    out = []
    for report in stats.get("skipped", []):
        if getattr(report, "wasxfail", None) is not None:
            continue
        reason = _skip_reason(report)
        if GPU_SKIP_REASON in reason or GPU_HERE_REASON in reason:
            continue
        if not any(fnmatch.fnmatchcase(report.nodeid, pattern) for pattern in SKIPS_ALLOWED_ON_CI):
            out.append((report.nodeid, reason))
    return out


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "workerinput", None) is not None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    session.config._normfuse_unexpected_skips = skips = unexpected_skips(reporter.stats)
    if skips and _in_ci() and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skips = getattr(config, "_normfuse_unexpected_skips", None)
    if not skips:
        return
    verdict = "fail the run on CI" if _in_ci() else "would fail the run on CI (CI=true)"
    terminalreporter.section("skips not on tests/conftest.py's SKIPS_ALLOWED_ON_CI")
    for nodeid, reason in skips:
        terminalreporter.line(f"{nodeid}: {reason}")
    terminalreporter.line(f"{len(skips)} skip(s) without a GPU reason and not allowed: they {verdict}")

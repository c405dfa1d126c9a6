"""Makes skipped checks visible under `pytest -q` (the Makefile's): the deployment checks skip
when scripts/setup.sh could not install their tools, and the summary should say so."""


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section("skipped checks")
    for rep in skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        terminalreporter.write_line(f"SKIPPED {rep.nodeid}: {reason}")

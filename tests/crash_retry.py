"""A test whose xdist worker dies of a native crash runs once more on a fresh worker, and the crash is printed.

XLA's CPU runtime has killed late workers while loading an executable from the shared compilation cache (abort or
segfault, never twice for one test): a core dump showed the worker at the kernel's limit on memory mappings, which
`tests/conftest.py:release_compiled_programs` now keeps it from reaching. Should a worker still die, xdist keeps its
other results, but the test it was running is lost; its re-run decides it: a second crash, or any ordinary failure,
fails as usual. Every crash is listed in the terminal summary, so none goes unseen.
"""

from __future__ import annotations

import pytest

RERUNS_AFTER_A_CRASH = 1


class CrashRetry:
    def __init__(self) -> None:
        self.crashes: dict[str, list[str]] = {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched) -> None:
        seen = self.crashes.setdefault(crashitem, [])
        seen.append(str(report.longrepr))
        if len(seen) <= RERUNS_AFTER_A_CRASH and hasattr(sched, "mark_test_pending"):
            sched.mark_test_pending(crashitem)
            report.outcome = "rerun"  # neither passed nor failed: the re-run's report decides

    def pytest_report_teststatus(self, report: pytest.TestReport):
        if report.outcome == "rerun":
            return "rerun", "R", "RERUN after a worker crash"
        return None

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.crashes:
            return
        terminalreporter.section("worker crashes")
        for nodeid, messages in self.crashes.items():
            verdict = "re-run" if len(messages) <= RERUNS_AFTER_A_CRASH else "failed: it crashed again"
            terminalreporter.line(f"{nodeid}: crashed {len(messages)}× ({verdict}); {messages[-1]}")


def register(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(CrashRetry(), "jengine-crash-retry")

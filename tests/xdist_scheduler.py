"""`make test`'s scheduler: pytest-xdist's `--dist loadgroup`, safe when a pytest worker dies.

A worker dies when a test takes its interpreter down (a crash inside TensorFlow) or when pytest-timeout's thread
method ends a hung test. xdist 3.8 then replaces the worker, but its group scheduler can leave the run waiting
forever with both workers idle (pytest-dev/pytest-xdist#1323, #1327, #1378, #1371): the dead worker's finished
groups go back on the queue as empty work (the worker that gets one is never told to go on), a replacement given
a one-test group waits for a second test that never comes, and the test that killed the worker is run again. A CI
run would then end at its time limit with no report. Here the dead worker's unfinished tests go back to the
front of the queue without the one it died on (already reported as failed), and a worker whose queue has run dry
is told so at once, so it runs its last test and the run ends.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

__all__ = ["CrashSafeLoadGroupScheduling"]


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    """`--dist loadgroup` that a dead worker cannot stall (see the module docstring)."""

    def remove_node(self, node) -> str | None:
        workload = self.assigned_work.pop(node)
        unfinished = {group: unit for group, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        # Tests of a unit run in collection order: the first unfinished one is the one the worker died on.
        crashed = next(nodeid for unit in unfinished.values() for nodeid, done in unit.items() if not done)
        for unit in unfinished.values():
            if crashed in unit:
                unit[crashed] = True  # reported as failed by xdist; run again, it could take the next worker too
        rest = [(group, unit) for group, unit in unfinished.items() if not all(unit.values())]
        queued = list(self.workqueue.items())
        self.workqueue.clear()
        self.workqueue.update(rest + queued)  # first: these units had started, longest first
        for other in self.nodes:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
            # A worker runs a test once it knows the next one (or that none comes): never leave it one alone.
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)
        if not self.workqueue:  # every worker, not only this one, may be waiting to hear that nothing comes
            for each in self.nodes:
                if not each.shutting_down:
                    each.shutdown()

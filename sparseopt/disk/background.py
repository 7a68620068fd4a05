"""`Background`: one thread beside the step that runs a table's host work, in order.

A table on disk hands it what the step need not wait for: the optimizer's
write of the step's rows into the cache, and the writing of evicted rows
into the files (`NativeRowCache.drain`). The step's compiled work, Keras'
loop and the next step's dispatch run meanwhile; whatever reads the cache
or the files next waits for it first (`wait`), so every read sees every
write before it, as if they had run in the step.

A job that fails (a full disk) is kept and raised by the next `wait`, in
the step that next reads the table, or its flush: the error names the table
(the files' own errors do), and the jobs after it still run, so rows
evicted before it still reach the files.
"""

import collections
import threading
import time
import traceback


class Background:
    """A thread that runs jobs (functions of no arguments) one after another.

    Args:
        name: the thread's name (the table's), for debuggers.
    """

    def __init__(self, name):
        self.name = name
        self._jobs = collections.deque()
        self._pending = 0
        self._error = None
        self._ready = threading.Condition()
        self._thread = None
        self._closed = False
        # Seconds its jobs took (wall clock, on its thread): what a table reports as the
        # work beside its steps.
        self.busy = 0.0

    def on_its_thread(self):
        """Whether the caller is this object's thread (running one of its jobs)."""
        return threading.current_thread() is self._thread

    def submit(self, job):
        """Runs `job` after the jobs submitted before it, on the thread.

        Raises:
            RuntimeError: after `close`.
        """
        with self._ready:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed; no more work is taken")
            self._jobs.append(job)
            self._pending += 1
            if self._thread is None:
                # A daemon: it never keeps Python from exiting; a table's
                # finalizer waits for its jobs at exit before flushing.
                self._thread = threading.Thread(target=self._run, name=self.name,
                                                daemon=True)
                self._thread.start()
            self._ready.notify_all()

    def _run(self):
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                job = self._jobs.popleft()
            if job is None:  # (`close`)
                return
            start = time.perf_counter()
            try:
                job()
            except BaseException as error:  # noqa: BLE001 (kept for `wait`)
                # (Its frames would keep the job's table alive until then.)
                traceback.clear_frames(error.__traceback__)
                with self._ready:
                    self._error = self._error or error
            finally:
                # Nothing of a job outlives it here: it holds a table's cache and
                # files, whose lock a table opened again on the folder needs.
                job = None
                with self._ready:
                    self.busy += time.perf_counter() - start
                    self._pending -= 1
                    self._ready.notify_all()

    def close(self):
        """Ends the thread once the jobs submitted have run (a failed one is still raised by
        the next `wait`); no job is taken after (`submit` raises)."""
        with self._ready:
            self._closed = True
            while self._pending and not self.on_its_thread():  # (a job closing: no wait)
                self._ready.wait()
            if self._thread is not None:
                self._jobs.append(None)  # (the thread's last: no job is left to race it)
                self._thread = None
                self._ready.notify_all()

    def wait(self):
        """Returns when every job submitted has run; raises the first that failed since the
        last `wait` (once).

        Raises:
            RuntimeError: called from a job (it would wait for itself).
        """
        if self.on_its_thread():
            raise RuntimeError(f"{self.name}: a job cannot wait for the jobs (itself too)")
        with self._ready:
            while self._pending:
                self._ready.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

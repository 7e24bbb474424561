# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The ``Work`` of an asynchronous staged collective: its result reaches the caller's tensors exactly once."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

_SWITCH = "VLLM_OMNI_PERSISTENT_COLLECTIVES=0"  # how a caller who needs the plain Work gets it


class Completion:
    """Waits for each of a staged collective's works once (gloo cannot wait on a send twice), then finishes it.

    Until then it holds the caller's tensors (``holds``), as a backend's ``Work`` holds its own: their storages
    cannot be freed and reused by a later call while this one is in flight. Once finished it holds nothing:
    neither the works (gloo's keep their tensors) nor the workspace's views. A failure is kept and raised again
    by every later ``wait()``, as a failed ``Work`` does.
    """

    def __init__(
        self,
        works: Sequence[Any],
        copy_out: Callable[[], None],
        release: Callable[[], None],
        holds: Sequence[Any] = (),
    ) -> None:
        self.works = list(works)
        self.holds = tuple(holds)
        self.done = False
        self.dropped = False  # its StagedWork was collected unwaited: the layer finishes it
        self.error: BaseException | None = None
        self._copy_out, self._release = copy_out, release
        self._lock = threading.RLock()

    def ready(self) -> bool:
        return self.done or all(work.is_completed() for work in self.works)

    def wait(self, *args: Any, **kwargs: Any) -> None:
        """Raises what a work's ``wait`` raised. A timeout leaves the call in flight, its workspace busy, and a
        later ``wait()`` goes on from the work it stopped at, as a plain ``Work`` may be waited again."""
        with self._lock:
            if not self.done:
                try:
                    while self.works:
                        self.works[0].wait(*args, **kwargs)
                        self.works.pop(0)
                    self._copy_out()
                except BaseException as error:
                    if self.works and not self.works[0].is_completed():
                        raise  # still running on the workspace: not finished, not freed
                    self.error = error
                finally:
                    if self.error is not None or not self.works:
                        self._finish()
            if self.error is not None:
                raise self.error

    def _finish(self) -> None:
        self.done = True
        self._release()
        self.works, self.holds, self._copy_out, self._release = [], (), None, None


class StagedWork(dist.Work):
    """The ``Work`` of an asynchronous staged collective: copies out and frees the workspace once waited on.

    A work dropped without ``wait()`` is finished by the layer's next call once the backend has completed it,
    never by blocking, or when the layer is uninstalled: its result then reaches the caller's tensors and its
    workspace is freed. A later call on the same tensors, or a barrier of its group, finishes it first.
    Every ``StagedWork`` of one ``batch_isend_irecv`` waits for the whole batch, since its receives are copied
    out together.
    """

    def __init__(self, completion: Completion, orphans: Callable[[Completion], None]) -> None:
        super().__init__()
        self._completion = completion
        weakref.finalize(self, orphans, completion).atexit = False

    @torch._dynamo.disable
    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._completion.wait(*args, **kwargs)
        return True

    def synchronize(self) -> None:
        self.wait()

    @torch._dynamo.disable
    def is_completed(self) -> bool:
        if not self._completion.ready():
            return False
        with contextlib.suppress(Exception):  # a failure is the work's, kept for wait() and exception()
            self._completion.wait()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._completion.error is None

    def exception(self) -> Any:
        self.is_completed()
        return self._completion.error

    def result(self) -> Any:
        raise NotImplementedError(f"result() on a staged collective: read the tensors you passed, or set {_SWITCH}")

    def get_future(self) -> Any:
        raise NotImplementedError(
            f"get_future() on a collective staged through a persistent workspace: call wait() instead, or set {_SWITCH}"
        )

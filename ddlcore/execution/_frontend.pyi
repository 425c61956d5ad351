"""Types of the compiled ``_frontend`` module (``_frontend.pyx``): a one-host communicator's
collectives in one native step, and the calls' check word."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

DECLINED: Final[object]

def check_word(kind: int, code: int, op: int, count: int, root: int, chunk: int) -> int: ...

class FrontEnd:
    enabled: bool
    def __init__(
        self,
        host: Any,
        executor: Any,
        calls: list[Any] | None,
        ends: list[float] | None,
        dtypes: Sequence[Any],
        ops: tuple[Mapping[str, Any], type],
        names: tuple[Any, Any, Any, Any],
        failed: Callable[..., BaseException],
        broken: Callable[[BaseException, int], None],
        links: Any = None,
    ) -> None: ...
    def allreduce(self, x: Any, op: Any, out: Any) -> Any: ...
    def broadcast(self, x: Any, root: Any) -> Any: ...
    def barrier(self) -> bool: ...

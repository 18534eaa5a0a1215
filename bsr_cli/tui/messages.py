"""The messages `bsr top`'s thread workers post to the UI thread, past tense: they report what a worker did."""

from __future__ import annotations

from textual.message import Message

from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.results import AbortAnswer
from bsr_cli.tui.model import Frame
from bsr_cli.tui.source import PollFailure


class SnapshotReceived(Message):
    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame


class PollFailed(Message):
    def __init__(self, failure: PollFailure) -> None:
        super().__init__()
        self.failure = failure


class FaultInjected(Message):
    def __init__(self, fault: FaultSpec) -> None:
        super().__init__()
        self.fault = fault


class FaultsCleared(Message):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count


class RequestAborted(Message):
    def __init__(self, result: AbortAnswer) -> None:
        super().__init__()
        self.result = result


class ActionFailed(Message):
    def __init__(self, what: str, failure: PollFailure) -> None:
        super().__init__()
        self.what = what
        self.failure = failure


class RecordingFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

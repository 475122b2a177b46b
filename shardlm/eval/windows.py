"""Overlapping evaluation windows: every token after the first is scored exactly once.

A stream of N tokens has N - 1 targets (token j + 1 predicted from tokens 0..j). With context L and
stride s (1 <= s <= L), window k feeds tokens `[k s, min(k s + L, N - 1))` and predicts the token
after each. Window 0 scores all its targets; a later window scores only targets from position
`k s + L - s` on, i.e. its last s (fewer in the last window). So each scored target sees at least
L - s earlier tokens, the scored ranges tile `[0, N - 1)` without gaps or overlap, and there are
`1 + ceil(max(N - 1 - L, 0) / s)` windows. These are the reference implementation's windows
(Megatron-LM `tasks/zeroshot_gpt`), without its trailing all-padding ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlm.errors import UserError


@dataclass(frozen=True)
class Window:
    """Inputs are tokens[start:end]; targets tokens[start + 1:end + 1]; targets at input offsets
    >= `first_scored` count (absolute target positions first_scored + start .. end - 1)."""

    start: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.start - self.first_scored


def num_windows(num_tokens: int, context: int, stride: int) -> int:
    """Windows needed to score the N - 1 targets of `num_tokens` tokens (0 when N < 2)."""
    if num_tokens < 2:
        return 0
    return 1 + math.ceil(max(num_tokens - 1 - context, 0) / stride)


def evaluation_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The overlapping windows over a stream of `num_tokens` tokens (see the module docstring)."""
    if context < 1:
        raise UserError(f"evaluation context={context} must be at least 1")
    if not 1 <= stride <= context:
        raise UserError(f"stride={stride} must be between 1 and the context length {context}; pass --stride")
    targets = num_tokens - 1
    windows = []
    for k in range(num_windows(num_tokens, context, stride)):
        start = k * stride
        end = min(start + context, targets)
        windows.append(Window(start, end, 0 if k == 0 else context - stride))
    return windows

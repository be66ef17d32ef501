"""The constrained-decoding seam: a per-request token constraint the engine consults every step.

A constraint (a grammar matcher such as llguidance's, later) writes which tokens may come next
into the step's allowed-token bitmask and is told which token was drawn:

* before sampling, the engine calls ``fill_bitmask(bitmask, row)`` for each row whose request
  carries a constraint; ``bitmask`` is int32 [B, ceil(V / 32)] on the host, initialised to all
  bits set, and bit j of word i allows token 32 i + j (llguidance's layout);
* the sampler applies it after logit_bias, the min_tokens mask and the penalties and before
  temperature / top-k / top-p / min-p (engine/sampling.py), so logprobs are those of the
  constrained distribution;
* ``Scheduler.update_from_output`` calls ``accept_token(token_id)`` with the drawn token, then
  finishes the request with "stop" once ``is_terminated()`` (end of turn accepted, or the
  constraint failed: a grammar error is logged by the constraint and its row allows only the end
  of turn, so no row is ever all -inf);
* ``only_end_of_turn()`` (asked after ``fill_bitmask``) says nothing but an end-of-turn id may
  follow: the ``min_tokens`` eos mask then yields for that row (``ignore_eos`` needs nothing: the
  constraint terminates on the end of turn it accepted);
* speculative decoding (docs/serving.md §13) advances the constraint over the drafted tokens it
  allows to fill each verified row's bitmask, then calls ``rollback(n)`` to undo those n
  ``accept_token`` calls (n <= MAX_SPECULATIVE_TOKENS) before the accepted tokens are accepted for good;
* the constraint stays with its request across preemption (recompute replays no draws, so it is
  neither reset nor replayed); ``n > 1`` fans out into n requests with one constraint each.
"""

from __future__ import annotations

from typing import Protocol

import torch

#: Bits per int32 word of the allowed-token bitmask (llguidance's layout).
BITMASK_WORD_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / BITMASK_WORD_BITS)."""
    return -(-vocab_size // BITMASK_WORD_BITS)


class TokenConstraint(Protocol):
    """What the engine needs from a per-request constraint (see the module docstring)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [ceil(V / 32)])."""

    def accept_token(self, token_id: int) -> None:
        """Advance past the drawn ``token_id``."""

    def is_terminated(self) -> bool:
        """True once the constrained output is complete (or failed)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` ``accept_token`` calls (speculative decoding)."""

    def only_end_of_turn(self) -> bool:
        """True when the row just filled allows nothing but end-of-turn ids."""

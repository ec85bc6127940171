"""The token dispatcher interface: moving routed tokens to their experts' ranks and back, in explicit stages.

    dispatch:  dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    combine:   combine_preprocess  -> token_combine  -> combine_postprocess

`token_dispatch` / `token_combine` are the communication stages; the others are local compute. Each stage is a
method taking and returning explicit values, and everything dispatch knows that combine needs travels in a
`DispatchState` object returned by dispatch and passed to combine (no module or process globals). A scheduler can
therefore run one micro-batch's communication stage on another stream while another micro-batch computes.
Backends (DeepEP today; HybridEP or DeepEP V2 later) subclass `TokenDispatcher`; the model never changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DispatchState", "TokenDispatcher"]


@dataclass
class DispatchState:
    """What combine needs from dispatch. Backends subclass it; it owns the communication layout, so dropping it
    (and the autograd graph) frees everything."""


class TokenDispatcher(ABC):
    """Moves token copies from `topk_idx` routing to expert-major inputs of the local experts, and back."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """x (num_tokens, dim), topk_idx (num_tokens, top_k) global expert ids (-1: none), topk_weights
        (num_tokens, top_k) -> expert_input (rows, dim) local-expert-major, tokens_per_local_expert
        (num_local_experts,), state."""
        prepared = self.dispatch_preprocess(x, topk_idx, topk_weights)
        dispatched = self.token_dispatch(prepared)
        return self.dispatch_postprocess(dispatched)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """expert_output (rows, dim) in the order of `dispatch`'s expert_input -> out (num_tokens, dim)."""
        prepared = self.combine_preprocess(expert_output, state)
        combined = self.token_combine(prepared, state)
        return self.combine_postprocess(combined, state)

    @abstractmethod
    def dispatch_preprocess(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """Local: put the routing into the form the communication needs (dtypes, layout)."""

    @abstractmethod
    def token_dispatch(self, prepared: Any) -> Any:
        """Communication: send token copies to the ranks holding their experts."""

    @abstractmethod
    def dispatch_postprocess(self, dispatched: Any) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """Local: order received tokens for the experts -> (expert_input, tokens_per_local_expert, state)."""

    @abstractmethod
    def combine_preprocess(self, expert_output: torch.Tensor, state: DispatchState) -> Any:
        """Local: undo the expert ordering, reduce what can be reduced before sending back."""

    @abstractmethod
    def token_combine(self, prepared: Any, state: DispatchState) -> Any:
        """Communication: return the results to the tokens' source ranks and sum them."""

    @abstractmethod
    def combine_postprocess(self, combined: Any, state: DispatchState) -> torch.Tensor:
        """Local: final layout (num_tokens, dim)."""

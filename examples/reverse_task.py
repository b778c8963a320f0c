"""A verifiable toy task: reverse a short word. ``abc=`` should be continued with ``cba</s>``.

The reward is the fraction of answer positions right (over the longer of answer and target),
so partial answers earn partial credit and GRPO has a gradient from the first iteration.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trainer_svc.domain import SequenceBatch

ALPHABET = "abcdefgh"


@dataclass(frozen=True)
class Prompt:
    word: str
    tokens: list[int]


class ReverseTask:
    def __init__(self, tokenizer, *, min_len: int = 3, max_len: int = 5) -> None:
        self.tokenizer = tokenizer
        self.min_len, self.max_len = min_len, max_len
        self.eos = tokenizer.eos_token_id

    def prompt(self, rng: random.Random) -> Prompt:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(self.min_len, self.max_len)))
        tokens = [self.tokenizer.bos_token_id, *self._encode(word + "=")]
        return Prompt(word, tokens)

    def answer(self, prompt: Prompt) -> list[int]:
        return [*self._encode(prompt.word[::-1]), self.eos]

    def reward(self, prompt: Prompt, completion: list[int]) -> float:
        target = self.answer(prompt)
        right = sum(a == b for a, b in zip(completion, target, strict=False))
        return right / max(len(completion), len(target))

    def supervised_batch(self, rng: random.Random, size: int) -> SequenceBatch:
        """Prompts with their answers; the loss covers the answers."""
        tokens, masks = [], []
        for _ in range(size):
            prompt = self.prompt(rng)
            answer = self.answer(prompt)
            tokens.append(prompt.tokens + answer)
            masks.append([False] * len(prompt.tokens) + [True] * len(answer))
        return SequenceBatch.from_lists(tokens, loss_mask=masks)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

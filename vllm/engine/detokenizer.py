"""Incremental detokenisation and stop-string detection for one sequence.

Invariants:
- `text == "".join(token_texts)`: each generated token is credited with the text
  it completed. A token that ends inside a multi-byte character gets "" and the
  token that completes the character gets all of it, so per-token strings always
  concatenate to the output text (OpenAI clients rely on this for offsets).
- Text is decoded over a short sliding window that starts a few tokens before the
  newest ones, so tokenizers that drop a leading space at the start of a decode
  still produce the right spacing.
"""

from __future__ import annotations

from typing import Optional

from vllm.sampling_params import SamplingParams
from vllm.tokenizer import IdDecoder

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: IdDecoder, prompt_token_ids: list[int], params: SamplingParams):
        self.decode = decode  # vllm.tokenizer.id_decoder's: the tokenizer's decode, cheaper
        self.params = params
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.token_texts: list[str] = []
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        # Characters a streaming caller must not see yet: a stop string may still end there.
        self.stop_holdback = 0 if params.include_stop_str_in_output else max(self._max_stop_len - 1, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, self.params.skip_special_tokens, self.params.spaces_between_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int], finished: bool, check_stop: bool = True) -> Optional[str]:
        """Append tokens; returns the stop string that ended the text, if any."""
        for i, token_id in enumerate(new_token_ids):
            self.ids.append(token_id)
            last = finished and i == len(new_token_ids) - 1
            delta = self._delta(final=last)
            self.token_texts.append(delta)
            self.text += delta
            if check_stop and delta and self.params.stop:
                stop = self._find_stop(len(delta))
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, delta_len: int) -> Optional[str]:
        search_from = max(len(self.text) - delta_len - self._max_stop_len + 1, 0)
        for stop in self.params.stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self._truncate(end)
                return stop
        return None

    def _truncate(self, length: int) -> None:
        """Cut text to `length` characters, keeping token_texts consistent with it."""
        self.text = self.text[:length]
        remaining = length
        for i, piece in enumerate(self.token_texts):
            if remaining <= len(piece):
                self.token_texts[i] = piece[:remaining]
                for j in range(i + 1, len(self.token_texts)):
                    self.token_texts[j] = ""
                return
            remaining -= len(piece)

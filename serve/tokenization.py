"""The DeepSeek tokenizer of a checkpoint or engine directory (the `tokenizers` library, loaded lazily)."""
from __future__ import annotations

import functools
from pathlib import Path


class TokenizerError(ValueError):
    pass


@functools.lru_cache(maxsize=8)
def _load(path: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)


class DeepseekTokenizer:
    """Encode prompts (BOS prepended, as the DeepSeek chat encoding does) and decode outputs."""

    def __init__(self, model_dir: str | Path, bos_token_id: int = 0):
        path = Path(model_dir) / "tokenizer.json"
        if not Path(model_dir).is_dir():
            raise TokenizerError(f"{model_dir}: directory not found")
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found")
        self.tok, self.bos_token_id = _load(str(path)), bos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

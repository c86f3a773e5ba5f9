"""Tokenizers for the training data: raw UTF-8 bytes (always available) and GPT-2 (tiktoken).

Both share one small interface: ``name``, ``vocab_size``, ``eot_token`` (``None`` for bytes),
``encode(text) -> np.ndarray`` and ``decode(ids) -> str``. GPT-2's ``encode`` treats its input as
one document and appends the end-of-text token, as nanoGPT's OpenWebText preparation does.
"""
from __future__ import annotations

import logging
from typing import Iterable, Protocol, Union

import numpy as np

log = logging.getLogger(__name__)

TOKENIZERS = ("bytes", "gpt2", "auto")
TextLike = Union[str, bytes, bytearray, memoryview]


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_token: int | None

    def encode(self, text: TextLike) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _ids_array(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if arr.ndim != 1:
        raise ValueError(f"ids has shape {arr.shape}; accepted: a 1-D sequence of token ids")
    return arr


class ByteTokenizer:
    """One token per UTF-8 byte: vocab_size 256, lossless, needs nothing from the network."""

    name = "bytes"
    vocab_size = 256
    eot_token = None

    def encode(self, text: TextLike) -> np.ndarray:
        """UTF-8 bytes of ``text`` (a str, or bytes taken as they are) as uint16 ids."""
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(f"text is a {type(text).__name__}; accepted: str or bytes")
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Bytes back to text; invalid UTF-8 becomes U+FFFD."""
        arr = _ids_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            bad = arr[(arr < 0) | (arr > 255)][0]
            raise ValueError(f"ids contains {int(bad)}; accepted: byte ids 0..255")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class GPT2Tokenizer:
    """tiktoken's "gpt2" encoding behind the common interface (vocab_size 50257)."""

    name = "gpt2"

    def __init__(self, encoding) -> None:
        self._enc = encoding
        self.vocab_size: int = int(encoding.n_vocab)
        self.eot_token: int = int(encoding.eot_token)

    def encode(self, text: TextLike) -> np.ndarray:
        """One document: ``encode_ordinary(text)`` followed by the end-of-text token.

        Bytes are decoded as UTF-8 (invalid sequences become U+FFFD). Special-token strings in
        the text are encoded as ordinary text, never as control tokens.
        """
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        elif not isinstance(text, str):
            raise TypeError(f"text is a {type(text).__name__}; accepted: str or bytes")
        ids = self._enc.encode_ordinary(text)
        ids.append(self.eot_token)
        return np.asarray(ids, dtype=np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in _ids_array(ids)])

    def __repr__(self) -> str:
        return "GPT2Tokenizer(tiktoken 'gpt2')"


_OFFLINE_HINT = ("the GPT-2 vocabulary is not available offline (tiktoken downloads it on first use "
                 "and caches it); `--tokenizer bytes` (ByteTokenizer) works without it")


def gpt2_tokenizer() -> GPT2Tokenizer:
    """tiktoken's GPT-2 encoding, or ValueError when tiktoken or its vocabulary is unavailable."""
    try:
        import tiktoken
    except ImportError as e:
        raise ValueError(f"tokenizer='gpt2' needs the tiktoken package, which is not installed "
                         f"(pip install tiktoken); also {_OFFLINE_HINT}") from e
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:      # network errors, missing cache, corrupt download: all the same here
        raise ValueError(f"tokenizer='gpt2': tiktoken could not load the 'gpt2' encoding "
                         f"({type(e).__name__}: {e}); {_OFFLINE_HINT}") from e
    return GPT2Tokenizer(enc)


def get_tokenizer(name: str = "auto") -> ByteTokenizer | GPT2Tokenizer:
    """``"bytes"``, ``"gpt2"``, or ``"auto"`` (GPT-2 when available, else bytes; logged)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return gpt2_tokenizer()
    if name == "auto":
        try:
            tok = gpt2_tokenizer()
        except ValueError as e:
            log.info("tokenizer='auto': using bytes (vocab 256) because %s", e)
            return ByteTokenizer()
        log.info("tokenizer='auto': using tiktoken gpt2 (vocab %d)", tok.vocab_size)
        return tok
    raise ValueError(f"tokenizer={name!r} is unknown; accepted: {', '.join(TOKENIZERS)}")

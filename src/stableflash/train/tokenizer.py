"""Tokenizers for the training data: raw UTF-8 bytes (always available), GPT-2 (tiktoken), and a
BPE saved by the ``tokenizers`` package (``tokenizer.json``, e.g. the installed-packages corpus's).

All share one small interface: ``name``, ``vocab_size``, ``eot_token`` (``None`` for bytes),
``encode(text) -> np.ndarray`` and ``decode(ids) -> str``. GPT-2's and the BPE's ``encode`` treat their
input as one document and append the end-of-text token, as nanoGPT's OpenWebText preparation does.
"""
from __future__ import annotations

import logging
from typing import Iterable, Protocol, Union

import numpy as np

log = logging.getLogger(__name__)

TOKENIZERS = ("bytes", "gpt2", "auto", "a tokenizer.json path")
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


class BPETokenizer:
    """A ``tokenizers`` BPE read from its ``tokenizer.json`` (plain JSON: loading it runs no code),
    with the end-of-text id after its entries (``vocab_size = entries + 1``), as
    :mod:`stableflash.train.packages_corpus` writes it. The end-of-text token is an id only: the
    text ``<|endoftext|>`` inside a document is encoded as ordinary text."""

    name = "bpe"

    def __init__(self, path) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise ValueError(f"tokenizer={str(path)!r} needs the tokenizers package, which is not installed "
                             f"(pip install tokenizers)") from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:         # a missing file, damaged JSON, an unknown model: all the same here
            raise ValueError(f"tokenizer={str(path)!r} cannot be read ({type(e).__name__}: {e}); accepted: a "
                             f"tokenizer.json saved by the tokenizers package") from None
        self.path = str(path)
        self.eot_token: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.vocab_size: int = self.eot_token + 1

    def encode(self, text: TextLike) -> np.ndarray:
        """One document: its BPE ids followed by the end-of-text id (bytes decoded as UTF-8, invalid
        sequences becoming U+FFFD)."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        elif not isinstance(text, str):
            raise TypeError(f"text is a {type(text).__name__}; accepted: str or bytes")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        ids.append(self.eot_token)
        return np.asarray(ids, dtype=np.uint32 if self.vocab_size > 65536 else np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of ``ids``; each end-of-text id becomes ``<|endoftext|>``."""
        arr = _ids_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() > self.eot_token):
            bad = arr[(arr < 0) | (arr > self.eot_token)][0]
            raise ValueError(f"ids contains {int(bad)}; accepted: ids 0..{self.eot_token}")
        cuts = np.flatnonzero(arr == self.eot_token)
        pieces, start = [], 0
        for cut in [*cuts.tolist(), arr.size]:
            pieces.append(self._tok.decode([int(i) for i in arr[start:cut]], skip_special_tokens=False))
            start = cut + 1
        return "<|endoftext|>".join(pieces)

    def __repr__(self) -> str:
        return f"BPETokenizer({self.path!r}, vocab_size={self.vocab_size})"


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


def get_tokenizer(name: str = "auto") -> ByteTokenizer | GPT2Tokenizer | BPETokenizer:
    """``"bytes"``, ``"gpt2"``, ``"auto"`` (GPT-2 when available, else bytes; logged), or the path of
    a ``tokenizer.json`` (:class:`BPETokenizer`)."""
    if isinstance(name, str) and name.endswith(".json"):
        return BPETokenizer(name)
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

"""Training harness: token data, batches and their record/replay, and the training loop.

Only the data-side names are re-exported here; import the other modules directly
(``stableflash.train.config``, ``.loop``, ...).
"""
from stableflash.train.corpus import (corpus_fingerprint, default_data_dir, prepare_embedded,
                                      prepare_hf, prepare_text)
from stableflash.train.data import (BatchRecorder, BatchSampler, ReplaySampler, eval_batches,
                                    get_batch, load_split, write_split)
from stableflash.train.tokenizer import ByteTokenizer, get_tokenizer, gpt2_tokenizer

__all__ = ["BatchRecorder", "BatchSampler", "ByteTokenizer", "ReplaySampler", "corpus_fingerprint",
           "default_data_dir", "eval_batches", "get_batch", "get_tokenizer", "gpt2_tokenizer",
           "load_split", "prepare_embedded", "prepare_hf", "prepare_text", "write_split"]

"""Tokenizers: a dependency-free byte tokenizer and a wrapper for any Hugging Face `tokenizer.json`.

Both expose the same small interface, which is all that corpus preparation and the trainer use:

- `vocab_size`: the size of the embedding table the model needs;
- `eos_id`: the id appended after every document (GPT-2 style document separator);
- `encode(text) -> np.ndarray[int32]`, `encode_batch(texts) -> list[np.ndarray]`,
  `decode(ids) -> str`;
- `fingerprint`: a short string that changes whenever the id mapping could change, so that a
  tokenized corpus cached on disk is never reused with a different tokenizer.

No special tokens (BOS, ...) are added while encoding: documents are delimited only by `eos_id`,
which corpus preparation appends itself.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Sequence

import numpy as np

# Names that Hugging Face tokenizers commonly use for the end-of-document token, in the order we
# try them (GPT-2 / SmolLM, Llama-1/2 and T5, Gemma, Llama-3).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """Byte-level UTF-8 tokenizer: ids 0..255 are bytes, id 256 is the end-of-document token.

    Needs no download and no training, so the default corpus works on any machine; a model trained
    on it reports losses that convert to nats per byte trivially (one token is one byte, plus eos).
    """

    vocab_size = 257
    eos_id = 256
    eos_token = "<|endoftext|>"  # its name in the exported tokenizer.json (write_tokenizer_json)
    fingerprint = "byte-v1"

    def encode(self, text: str) -> np.ndarray:
        # errors='replace' keeps lone surrogates (which UTF-8 cannot encode) from aborting a run.
        data = text.encode("utf-8", errors="replace")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < 256)]  # drops eos (and anything out of range)
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def write_tokenizer_json(self, path: str) -> None:
        """This tokenizer as a Hugging Face ``tokenizer.json`` (what an export ships, so that
        ``AutoTokenizer`` loads it): GPT-2's byte-level alphabet as a BPE vocabulary with no merges,
        token ``b`` for byte ``b`` (so each byte is one token, with this tokenizer's ids), and
        :attr:`eos_token` as the added special token 256.  Encodes any text to the same ids as
        :meth:`encode`, except that the literal text of :attr:`eos_token` becomes id 256."""
        import tokenizers  # pylint: disable=import-outside-toplevel
        from tokenizers.pre_tokenizers import ByteLevel  # pylint: disable=import-outside-toplevel

        chars = _byte_level_chars()
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        tok.add_special_tokens([tokenizers.AddedToken(self.eos_token, special=True, normalized=False)])
        tok.save(path)


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (Radford et al. 2019, the ``bytes_to_unicode`` of its
    encoder), which byte-level pre-tokenizers use: printable Latin-1 bytes stand for themselves,
    the other 68 bytes map in order to the characters from U+0100 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return out


class HFTokenizer:
    """Any Hugging Face `tokenizers` model saved as a `tokenizer.json` file (e.g. SmolLM2's).

    Args:
      path: path to the `tokenizer.json` file.
      eos_token: the token that separates documents. When None, the first of `EOS_CANDIDATES` that
        exists in the vocabulary is used.
    """

    def __init__(self, path: str, eos_token: str | None = None):
        import tokenizers  # local import keeps `import asyncpp_jax.data` light for byte-only users

        self.path = os.path.abspath(os.path.expanduser(path))
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ValueError(
                f"config.data.tokenizer: could not load a Hugging Face tokenizer from "
                f"{self.path!r} ({e}). Pass a valid tokenizer.json file, or 'byte'."
            ) from e
        with open(self.path, "rb") as f:
            self.fingerprint = "hf-" + hashlib.sha256(f.read()).hexdigest()[:16]
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token, self.eos_id = self._find_eos(eos_token)

    def _find_eos(self, eos_token: str | None) -> tuple[str, int]:
        if eos_token is not None:
            eos_id = self._tok.token_to_id(eos_token)
            if eos_id is None:
                raise ValueError(
                    f"config.data.eos_token={eos_token!r} is not in the vocabulary of {self.path}. "
                    "Set config.data.eos_token to a token that exists in that tokenizer."
                )
            return eos_token, int(eos_id)
        for candidate in EOS_CANDIDATES:
            eos_id = self._tok.token_to_id(candidate)
            if eos_id is not None:
                return candidate, int(eos_id)
        raise ValueError(
            f"The tokenizer {self.path} has none of the usual end-of-document tokens "
            f"{list(EOS_CANDIDATES)}. Set config.data.eos_token to the token that separates "
            "documents in this tokenizer."
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # The library encodes a batch in parallel in Rust: what makes large corpora tractable.
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if int(i) != self.eos_id]
        return self._tok.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, eos_token={self.eos_token!r})"


Tokenizer = ByteTokenizer | HFTokenizer


def get_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """Builds the tokenizer named by `config.data.tokenizer`.

    Accepted: `'byte'`, or a path to a Hugging Face `tokenizer.json` file (or to a directory that
    contains one, such as a downloaded model snapshot).
    """
    if spec == "byte":
        if eos_token is not None:
            raise ValueError(
                f"config.data.eos_token={eos_token!r} only applies to Hugging Face tokenizers; "
                "the byte tokenizer's end-of-document id is always 256. Unset "
                "config.data.eos_token."
            )
        return ByteTokenizer()
    path = os.path.expanduser(str(spec))
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(path):
        return HFTokenizer(path, eos_token=eos_token)
    raise ValueError(
        f"config.data.tokenizer={spec!r} is not understood. Use 'byte' (byte-level UTF-8, "
        "nothing to download) or the path to an existing Hugging Face tokenizer.json file (e.g. "
        "one downloaded from the SmolLM2 model repository)."
    )


# SmolLM2's tokenizer.json: a byte-level BPE whose first special tokens are these (id 0 is
# <|endoftext|>, its end-of-document token), digits split one by one before the byte-level split.
SMOLLM2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_bpe(texts: Iterable[str], vocab_size: int, path: str,
              special_tokens: Sequence[str] = SMOLLM2_SPECIAL_TOKENS) -> str:
    """Train a tokenizer of SmolLM2's kind (byte-level BPE, single-digit pre-split, its special
    tokens first) on ``texts`` and save it as a ``tokenizer.json`` at ``path``; returns ``path``.

    For tests, benchmarks and the offline rehearsal of the ``paper`` preset: the same model type
    and pre-tokenizer as the published SmolLM2 tokenizer, so encoding costs about the same per byte.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return str(path)

"""Token ids <-> text for MiniMax-M2 checkpoints, on the ``tokenizers`` library.

docs/parsers.md §1: byte-level BPE from the checkpoint's ``tokenizer.json``; prompts are
encoded with no added special tokens (the chat template writes ``]~!b[`` itself) and special-token
strings inside the text map to their single ids. The special tokens are resolved by their text at
load time; a missing one is an error naming it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer


def _byte_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2 ``bytes_to_unicode``): the printable bytes
    ``!``-``~``, ``¡``-``¬``, ``®``-``ÿ`` stand for themselves; the other 68 bytes, in order, for
    U+0100, U+0101, ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


_BYTE_DECODER = _byte_alphabet()

BOS = "]~!b["  # start of document, written by the template
ROLE = "]~b]"  # role header prefix (generation_config.bos_token_id)
EOS = "[e~["  # end of message: eos / stop
THINK = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<minimax:tool_call>"
TOOL_CALL_END = "</minimax:tool_call>"
REQUIRED_TOKENS = (BOS, ROLE, EOS, THINK, THINK_END, TOOL_CALL, TOOL_CALL_END)
# The four parser tags reach the parser as text even when special tokens are skipped (docs/parsers.md §1).
PARSER_TAGS = (THINK, THINK_END, TOOL_CALL, TOOL_CALL_END)
PAD = "]!p~["
UNK = "]!d~["
# The tokens a MiniMax-M2 tokenizer adds after its BPE vocabulary, in the release's order (ids 200000
# onward there): the control tokens are special, the parser tags are ordinary added tokens.
CONTROL_TOKENS = (PAD, ROLE, EOS, UNK, BOS)
ADDED_TOKENS = CONTROL_TOKENS + PARSER_TAGS


def add_minimax_tokens(backend: _HFTokenizer) -> None:
    """Append ``ADDED_TOKENS`` to a freshly trained ``tokenizers`` BPE, as the embedded checkpoints'
    trainers do: ``CONTROL_TOKENS`` as special tokens (dropped by ``skip_special_tokens``), the four
    ``PARSER_TAGS`` as non-special added tokens, so any decoder (ours, transformers') yields them as
    text (docs/parsers.md §1). Each becomes one token; none is normalised."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in PARSER_TAGS])


class Tokenizer:
    """A checkpoint's tokenizer with the MiniMax-M2 special tokens resolved.

    Attributes: ``special_ids`` maps each of ``REQUIRED_TOKENS`` to its id; ``eos_token_id`` is the
    id of ``[e~[``; ``stop_token_ids`` are the eos ids of ``generation_config.json`` plus
    ``[e~[``; ``bos_token`` / ``eos_token`` / ``unk_token`` are the strings of
    ``tokenizer_config.json`` (the template variables); ``think_id``, ``think_end_id``,
    ``tool_call_id``, ``tool_call_end_id`` are the parser tags' ids.
    """

    def __init__(self, backend: _HFTokenizer, bos_token: str = BOS, eos_token: str = EOS,
                 unk_token: str | None = None, generation_eos: Sequence[int] = (),
                 source: str = "tokenizer.json") -> None:
        self._tok = backend
        self.special_ids: dict[str, int] = {}
        for text in REQUIRED_TOKENS:
            tid = backend.token_to_id(text)
            if tid is None or backend.encode(text, add_special_tokens=False).ids != [tid]:
                raise ValueError(f"{source}: special token {text!r} is missing or not a single token; "
                                 f"a MiniMax-M2 tokenizer needs all of {', '.join(REQUIRED_TOKENS)}")
            self.special_ids[text] = tid
        self.bos_token, self.eos_token, self.unk_token = bos_token, eos_token, unk_token
        self.eos_token_id = self.special_ids[EOS]
        self.think_id = self.special_ids[THINK]
        self.think_end_id = self.special_ids[THINK_END]
        self.tool_call_id = self.special_ids[TOOL_CALL]
        self.tool_call_end_id = self.special_ids[TOOL_CALL_END]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*generation_eos, self.eos_token_id]))
        keep = {self.special_ids[t] for t in PARSER_TAGS}
        added = backend.get_added_tokens_decoder()
        self._skipped_ids = frozenset(i for i, tok in added.items() if tok.special and i not in keep)
        self._added_ids = frozenset(added)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json`` if present).

        Raises FileNotFoundError naming the missing ``tokenizer.json``, ValueError for a corrupt
        tokenizer.json, a missing special token or an unreadable config file.
        """
        d = Path(path)
        file = d / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: the checkpoint needs its tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise ValueError(f"{file}: not a valid tokenizers JSON file ({e})") from e
        config = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        eos = gen.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        return cls(backend, token_text(config.get("bos_token")) or BOS,
                   token_text(config.get("eos_token")) or EOS, token_text(config.get("unk_token")),
                   eos_ids, source=str(file))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self._tok.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Most characters one token can cover: the longest vocabulary string (a byte-level token of n
        bytes covers at most n characters). ``len(text) > n_tokens * max_token_chars`` proves that
        ``text`` has more than ``n_tokens`` tokens without tokenising it."""
        return max(len(t) for t in self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (added tokens included), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of an id (byte-level form for base tokens), or None."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw UTF-8 bytes of one token, also when it holds only part of a character.

        Base tokens of a byte-level BPE are stored in the GPT-2 byte alphabet (each byte 0-255 as one
        printable character); they are mapped back to their bytes. Added tokens, and vocabularies that
        are not byte-level, give their text encoded as UTF-8. Used for OpenAI logprob ``bytes``.
        An id with no token (the embedding is padded past the tokenizer, docs/model.md §1) gives b"".
        """
        tok = self._tok.id_to_token(token_id)
        if tok is None:
            return b""
        if token_id not in self._added_ids and all(ch in _BYTE_DECODER for ch in tok):
            return bytes(_BYTE_DECODER[ch] for ch in tok)
        return tok.encode("utf-8")

    def is_skipped(self, token_id: int) -> bool:
        """True for special tokens that are not output text (all but the four parser tags)."""
        return token_id in self._skipped_ids

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` with no added special tokens; special strings map to their single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``.

        With ``skip_special_tokens`` the special tokens are dropped except the four parser tags,
        which stay as text (docs/parsers.md §1). Invalid UTF-8 becomes U+FFFD.
        """
        ids = list(token_ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skipped_ids]
        return self._tok.decode(ids, skip_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def token_text(value: object) -> str | None:
    """A token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None

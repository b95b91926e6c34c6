"""Tokenizer built from GGUF metadata, reproducing llama.cpp's token ids exactly.

Two vocabulary families are supported, as llama.cpp names them:

* **SPM** (``tokenizer.ggml.model = "llama"``: LLaMA-1/2, Mistral, Phi-3, Gemma 1-3):
  spaces become ``▁`` (U+2581), an optional ``▁`` is prefixed
  (``tokenizer.ggml.add_space_prefix``, default true), then adjacent symbols are
  merged best-score-first with a priority queue over the whole fragment, and
  symbols that are not tokens fall back to ``<0xXX>`` byte tokens
  (llama-vocab.cpp ``llm_tokenizer_spm_session``).
* **BPE** (``"gpt2"``: GPT-2, Llama-3, Qwen, DeepSeek, Command-R, ...; and
  ``"gemma4"``): the text is split into words by the regexes of
  ``tokenizer.ggml.pre`` (see :mod:`opencoti.model.pretokenize`), each word is
  mapped to GPT-2's byte alphabet and merged lowest-rank-first using
  ``tokenizer.ggml.merges`` (llama-vocab.cpp ``llm_tokenizer_bpe_session``).
  Gemma-4 keeps raw UTF-8 with ``▁`` for spaces and splits only at newlines.

Before either runs, special tokens are cut out of the text
(llama-vocab.cpp ``tokenizer_st_partition``): USER_DEFINED tokens always,
CONTROL and UNKNOWN ones only with ``parse_special=True``; longest first.
Token attributes, the end-of-generation set and the per-model quirks follow
``llama_vocab::impl::load``.

Decoding mirrors ``llama_token_to_piece`` / ``llama_detokenize``: byte tokens
give their raw byte, SPM pieces turn ``▁`` back into spaces, BPE pieces are
mapped back from the byte alphabet, and BPE vocabularies (other than those
llama.cpp exempts) get its ``clean_up_tokenization_spaces`` passes.
"""

from __future__ import annotations

import codecs
import heapq
import operator
import re
from collections.abc import Iterable, Sequence

from opencoti.model import pretokenize as pt

# llama.h enum llama_token_type (the values stored in tokenizer.ggml.token_type)
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.h enum llama_token_attr (bit flags)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
ATTR_SINGLE_WORD = 1 << 9

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}

SPACE_ESCAPE = "\u2581"  # ▁, SentencePiece's stand-in for a space
_C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale

# Token texts llama.cpp recognises when the metadata does not name them (llama_vocab::impl::load)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                  "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                  "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                  "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

_K = "tokenizer.ggml."
_BPE_CACHE_MAX = 200_000


class TokenizerError(ValueError):
    """The vocabulary metadata is unusable, or a call got an invalid argument; the message says which."""


def _clean_pass_quotes(buf: bytearray) -> bytearray:
    """llama_detokenize clean_spaces, passes 2 and 3 (" ' " -> "'", " 's" -> "'s", ...)."""
    text = bytearray(buf)
    sp, ap = 0x20, 0x27
    # pass 2: a lone apostrophe between spaces loses both spaces
    n2 = len(text)
    total = 1 if n2 else 0
    i = 1
    while i < n2:
        x = text[i]
        if x == ap and i + 1 < n2 and text[i - 1] == sp and text[i + 1] == sp:
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    del text[total:]
    # pass 3: contractions 's 'm 're 've lose the space before them
    n3 = len(text)
    total = 1 if n3 else 0
    for i in range(1, n3):
        x = text[i]
        if text[i - 1] == sp and x == ap and i + 1 < n3:
            x1 = text[i + 1]
            if x1 in (0x73, 0x6D):  # s m
                total -= 1
            elif x1 not in (0x74, 0x64) and i + 2 < n3:  # not t d
                x2 = text[i + 2]
                if (x1 == 0x72 and x2 == 0x65) or (x1 == 0x76 and x2 == 0x65):  # re ve
                    total -= 1
        text[total] = x
        total += 1
    del text[total:]
    return text


_CLEAN_PASS1 = re.compile(rb" (?=[?!.,])")


class Tokenizer:
    """A llama.cpp-compatible tokenizer over one GGUF vocabulary.

    Build it with :meth:`from_metadata` (the ``metadata`` dict of
    :class:`opencoti.model.gguf_file.GGUFFile`). Token ids are ``int`` in
    ``[0, n_vocab)``; pieces are ``bytes`` (a piece may be part of a UTF-8
    sequence); text is ``str``.
    """

    # ----------------------------------------------------------------- loading

    def __init__(self) -> None:  # use from_metadata()
        self.model = ""
        self.pre = ""
        self.vocab_type = "none"  # "spm" | "bpe" | "none"
        self.pre_type = "default"
        self._tokens: list[str] = []
        self._scores: list[float] = []
        self._attrs: list[int] = []
        self._token_to_id: dict[str, int] = {}
        self._bpe_ranks: dict[str, int] = {}
        self._regexes: list[str] = []
        self._byte_encode = True
        self.add_space_prefix = False
        self.add_bos = False
        self.add_eos = False
        self.add_sep = False
        self.ignore_merges = False
        self.clean_spaces = False
        self.remove_extra_whitespaces = False
        self.escape_whitespaces = True
        self.lowercase = False
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eot_id: int | None = None
        self.eom_id: int | None = None
        self.unk_id: int | None = None
        self.sep_id: int | None = None
        self.pad_id: int | None = None
        self.mask_id: int | None = None
        self.fim_pre_id: int | None = None
        self.fim_suf_id: int | None = None
        self.fim_mid_id: int | None = None
        self.fim_pad_id: int | None = None
        self.fim_rep_id: int | None = None
        self.fim_sep_id: int | None = None
        self.eog_ids: frozenset[int] = frozenset()
        self._max_piece_chars: int | None = None  # max_piece_chars(), computed once
        self.suppress_tokens: list[int] = []  # tokenizer.ggml.suppress_tokens (never sampled)
        self.warnings: list[str] = []
        self._special_order: list[int] = []  # cache_special_tokens: longest text first
        self._special_rank: dict[int, int] = {}
        self._special_groups: dict[str, list[int]] = {}
        self._piece_cache: dict[int, bytes] = {}
        self._bpe_cache: dict[str, tuple[int, ...]] = {}
        self._nl_id: int | None = None

    @classmethod
    def from_metadata(cls, md: dict) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (``tokenizer.ggml.*`` and ``general.*`` keys).

        Follows llama.cpp ``llama_vocab::impl::load``: vocabulary type and defaults
        from ``tokenizer.ggml.model``, pre-tokenizer and its flags from
        ``tokenizer.ggml.pre``, special ids and ``add_*`` flags from their keys,
        token attributes from ``tokenizer.ggml.token_type`` plus the by-text
        detection of EOT/EOM/FIM/EOG tokens.

        Raises :class:`TokenizerError` for missing or malformed keys, an unknown
        tokenizer model or pre-tokenizer, or a vocabulary family not supported
        here (BERT WordPiece, T5 Unigram, RWKV, PLaMo-2).
        """
        if not isinstance(md, dict):
            raise TokenizerError("tokenizer metadata must be a dict of GGUF keys")
        self = cls()
        self._load(md)
        return self

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """Shorthand for ``Tokenizer.from_metadata(GGUFFile(path).metadata)``."""
        from opencoti.model.gguf_file import GGUFFile

        return cls.from_metadata(GGUFFile(path).metadata)

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def _load(self, md: dict) -> None:
        defaults = self._load_type(md)
        if self.vocab_type == "none":
            return
        self._load_vocab(md)
        ids = self._load_special_ids(md, defaults)
        self._load_flags(md, ids)
        self._detect_special_tokens(ids)
        for name, v in ids.items():
            setattr(self, name + "_id", v)
        self._build_special_cache()
        self._apply_model_attrs(md)

    def _load_type(self, md: dict) -> dict:
        """Vocabulary type, pre-tokenizer and their flags; returns the default special ids."""
        model = md.get(_K + "model")
        if model is None:
            raise TokenizerError("GGUF has no tokenizer: key 'tokenizer.ggml.model' is missing")
        if not isinstance(model, str):
            raise TokenizerError("invalid type for 'tokenizer.ggml.model' (expected a string)")
        pre = md.get(_K + "pre", "")
        if not isinstance(pre, str):
            raise TokenizerError("invalid type for 'tokenizer.ggml.pre' (expected a string)")
        self.model = model
        defaults = {"bos": None, "eos": None, "unk": None}
        if model in ("no_vocab", "none"):
            self.vocab_type = "none"
            n = md.get(f"{md.get('general.architecture', '')}.vocab_size") or 0
            self._tokens = [""] * int(n)
            return defaults
        if model == "llama":
            self.vocab_type = "spm"
            defaults = {"bos": 1, "eos": 2, "unk": 0}
        elif model in ("gpt2", "whitespace", "gemma4"):
            self.vocab_type = "bpe"
            merges = md.get(_K + "merges")
            if merges is None:
                if not (model == "gpt2" and pre == "kimi-k2"):
                    raise TokenizerError("cannot find tokenizer merges ('tokenizer.ggml.merges') in model file")
                merges = []
            if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges[:1]):
                raise TokenizerError("invalid type for 'tokenizer.ggml.merges' (expected an array of strings)")
            # rank of "left right"; the first occurrence of a pair wins (llama.cpp emplace)
            n_m = len(merges)
            self._bpe_ranks = dict(zip(reversed(merges), range(n_m - 1, -1, -1)))
            if model == "gemma4":
                pre = "gemma4"
            else:
                defaults = {"bos": 11, "eos": 11, "unk": None}
        elif model in ("bert", "t5", "rwkv", "plamo2", "hybriddna"):
            raise TokenizerError(f"tokenizer model '{model}' is not supported by opencoti yet")
        else:
            raise TokenizerError(f"unknown tokenizer: '{model}'")

        if self.vocab_type == "bpe":
            self.add_space_prefix = False
            self.escape_whitespaces = False
            self.clean_spaces = True
            if not pre:
                self._warn("missing pre-tokenizer type, using 'default' (generation quality will be degraded)")
            cfg = pt.PRE_NAMES.get(pre or "default")
            if cfg is None:
                raise TokenizerError(f"unknown pre-tokenizer type: '{pre}'")
            self.pre_type = cfg.pre_type
            if cfg.clean_spaces is not None:
                self.clean_spaces = cfg.clean_spaces
            self.ignore_merges = cfg.ignore_merges
            if cfg.add_bos is not None:
                self.add_bos = cfg.add_bos
            if cfg.escape_whitespaces:
                self.escape_whitespaces = True
            if cfg.no_bos_token:
                defaults["bos"] = None
            self.add_sep = cfg.add_sep
            self._regexes = pt.PRE_TYPE_REGEXES[cfg.pre_type]
            self._byte_encode = cfg.pre_type not in pt.RAW_UTF8_PRE_TYPES
        else:  # spm
            self.add_space_prefix = True
            self.clean_spaces = False
            self.add_bos = True
            self.add_eos = False
        self.pre = pre
        self.add_space_prefix = bool(md.get(_K + "add_space_prefix", self.add_space_prefix))
        self.remove_extra_whitespaces = bool(md.get(_K + "remove_extra_whitespaces", False))
        return defaults

    def _load_vocab(self, md: dict) -> None:
        """Token texts, scores and attributes (from token types)."""
        tokens = md.get(_K + "tokens")
        if tokens is None:
            raise TokenizerError("cannot find tokenizer vocab ('tokenizer.ggml.tokens') in model file")
        if not isinstance(tokens, list) or (tokens and not isinstance(tokens[0], str)):
            raise TokenizerError("invalid type for 'tokenizer.ggml.tokens' (expected an array of strings)")
        n = len(tokens)
        if n == 0:
            raise TokenizerError("'tokenizer.ggml.tokens' is empty")
        scores = md.get(_K + "scores")
        if scores is not None:
            if len(scores) < n:
                raise TokenizerError(f"Index out of array bounds for scores ({len(scores)} < {n})")
            self._scores = [float(s) for s in scores[:n]]
        else:
            self._scores = [0.0] * n
        types = md.get(_K + "token_type")
        if types is not None:
            if len(types) < n:
                raise TokenizerError(f"Index out of array bounds for toktypes ({len(types)} < {n})")
            tl = types[:n].tolist() if hasattr(types, "tolist") else list(types[:n])
            self._attrs = [_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in tl]
        else:
            self._attrs = [ATTR_NORMAL] * n

        toks = list(tokens)
        for i, w in enumerate(toks):
            if not w:
                self._warn(f"empty token at index {i}")
                toks[i] = f"[EMPTY_{i}]"
        t2i = dict(zip(toks, range(n)))
        if len(t2i) != n:
            seen: dict[str, int] = {}
            for i, w in enumerate(toks):
                if w in seen:
                    raise TokenizerError(f"duplicate token in vocabulary: '{w}' has ids {seen[w]} and {i}")
                seen[w] = i
        self._tokens = toks
        self._token_to_id = t2i

    _ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
                ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
                ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
                ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
                ("fim_sep", "fim_sep_token_id"),
                # deprecated spellings
                ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))

    def _load_special_ids(self, md: dict, defaults: dict) -> dict:
        """Special token ids: the type's defaults, overridden by in-range metadata values."""
        n = len(self._tokens)
        ids: dict[str, int | None] = {name: defaults.get(name) for name, _ in self._ID_KEYS}
        for name, key in self._ID_KEYS:
            cur = ids[name]
            if cur is not None and cur >= n:
                self._warn(f"default special token '{_K + key}' = {cur} out of vocab range, disabling")
                cur = None
            v = md.get(_K + key)
            if v is not None:
                try:
                    v = int(v)
                except (TypeError, ValueError):
                    raise TokenizerError(f"invalid type for '{_K + key}' (expected an integer)") from None
                if v < 0 or v >= n:
                    self._warn(f"bad special token: '{_K + key}' = {v}, using default id {cur}")
                else:
                    cur = v
            ids[name] = cur
        return ids

    def _load_flags(self, md: dict, ids: dict) -> None:
        """add_bos / add_eos / add_sep, normalizer and suppress-token keys."""
        for flag, key in (("add_bos", "add_bos_token"), ("add_eos", "add_eos_token"), ("add_sep", "add_sep_token")):
            v = md.get(_K + key)
            if v is not None:
                setattr(self, flag, bool(v))
        if self.pre_type == "gemma4" and not self.add_bos:
            self.add_bos = True  # llama.cpp workaround for Gemma 4
            self._warn("override 'tokenizer.ggml.add_bos_token' to 'true' for Gemma4")
        for flag, name, key in (("add_bos", "bos", "bos_token_id"), ("add_eos", "eos", "eos_token_id"),
                                ("add_sep", "sep", "seperator_token_id")):
            if getattr(self, flag) and ids[name] is None:
                # llama.cpp would abort when tokenizing with add_special; we drop the flag instead
                setattr(self, flag, False)
                self._warn(f"{flag} is set but {_K}{key} is not; not adding it")
        self.lowercase = bool(md.get(_K + "normalizer.lowercase", False))
        sup = md.get(_K + "suppress_tokens")
        if sup is not None:
            n = len(self._tokens)
            self.suppress_tokens = [int(t) for t in sup if 0 <= int(t) < n]

    def _detect_special_tokens(self, ids: dict) -> None:
        """EOT/EOM/FIM by text, unused control tokens, and the end-of-generation set (mutates ``ids``)."""
        toks, t2i, attrs = self._tokens, self._token_to_id, self._attrs
        # llama.cpp takes the first match in its hash-map order; we take the first text of its
        # list that the vocabulary has
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
                            ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS),
                            ("fim_pad", _FIM_PAD_TEXTS), ("fim_rep", _FIM_REP_TEXTS),
                            ("fim_sep", _FIM_SEP_TEXTS)):
            if ids[name] is not None:
                continue
            found = [t2i[t] for t in texts if t in t2i]
            if found:
                ids[name] = found[0]
                attrs[found[0]] |= ATTR_CONTROL
        for tid, a in enumerate(attrs):  # control tokens named "unused..." are unused
            if a & ATTR_CONTROL and not a & ATTR_UNUSED and "unused" in toks[tid]:
                attrs[tid] = a | ATTR_UNUSED

        eog = {ids[name] for name in ("fim_pad", "fim_rep", "fim_sep") if ids[name] is not None}
        for t in _EOG_TEXTS:
            tid = t2i.get(t)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        for t in _ALWAYS_USER_DEFINED:
            tid = t2i.get(t)
            if tid is not None:
                attrs[tid] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if ids[name] is not None and ids[name] not in eog:
                eog.add(ids[name])
                self._warn(f"special_{name}_id is not in special_eog_ids - the tokenizer config may be incorrect")
        eog_texts = {toks[t]: t for t in sorted(eog)}
        has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
        # o200k_harmony / solar-open: "<|end|>" is not an end of generation
        if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
            end_id = eog_texts["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is a normal token there (unlike paddleocr)
        if ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts) and "</s>" in eog_texts:
            s_id = eog_texts["</s>"]
            eog.discard(s_id)
            attrs[s_id] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    def _build_special_cache(self) -> None:
        """cache_special_tokens: CONTROL / USER_DEFINED / UNKNOWN ids, longest text first,
        plus an index by 3-character prefix to skip the ones a text cannot contain."""
        toks = self._tokens
        special = [i for i, a in enumerate(self._attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        special.sort(key=lambda i: -len(toks[i]))
        self._special_order = special
        self._special_rank = {tid: r for r, tid in enumerate(special)}
        groups: dict[str, list[int]] = {}
        for tid in special:
            groups.setdefault(toks[tid][:3], []).append(tid)
        self._special_groups = groups

    def _apply_model_attrs(self, md: dict) -> None:
        """LSTRIP / RSTRIP attributes llama.cpp sets by model, pre-tokenizer or architecture name."""
        t2i, attrs = self._token_to_id, self._attrs
        model_name = str(md.get("general.name", "")).lower()
        pre_key = str(md.get(_K + "pre", ""))
        arch = str(md.get("general.architecture", ""))

        def set_attr(text: str, attr: int, on: bool) -> None:
            tid = t2i.get(text)
            if tid is not None:
                attrs[tid] = attrs[tid] | attr if on else attrs[tid] & ~attr

        if any(s in pre_key for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert")) or \
                any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            set_attr("<mask>", ATTR_LSTRIP, True)
        elif "phi-3" in model_name or "phi3" in model_name:
            for tid in self._special_order:
                attrs[tid] |= ATTR_RSTRIP
            set_attr("</s>", ATTR_RSTRIP, True)
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(t, ATTR_RSTRIP, False)
        elif "modern-bert" in model_name:
            set_attr("[MASK]", ATTR_LSTRIP, True)

    # -------------------------------------------------------------- properties

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    @property
    def vocab_type_id(self) -> int:
        """``vocab_type`` as llama.cpp's ``enum llama_vocab_type`` (include/llama.h: NONE 0, SPM 1,
        BPE 2), the integer its server reports in ``/v1/models`` ``meta.vocab_type``."""
        return {"none": 0, "spm": 1, "bpe": 2}[self.vocab_type]

    @property
    def nl_id(self) -> int | None:
        """The newline token (SPM: the ``<0x0A>`` byte token; otherwise the first id of "\\n")."""
        if self._nl_id is None and self.vocab_type != "none":
            if self.vocab_type == "spm":
                self._nl_id = self._token_to_id.get("<0x0A>", self._token_to_id.get("\n", self.pad_id))
            else:
                ids = self.tokenize("\n", add_special=False)
                self._nl_id = ids[0] if ids else self.pad_id
        return self._nl_id

    def _check_id(self, tid) -> int:
        """``tid`` as a Python int (NumPy integers accepted); TokenizerError if not a valid id."""
        try:
            i = operator.index(tid)
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {type(tid).__name__}") from None
        if i < 0 or i >= len(self._tokens):
            raise TokenizerError(f"token id {i} out of range [0, {len(self._tokens)})")
        return i

    def token_text(self, tid: int) -> str:
        """The vocabulary entry of ``tid`` as stored in the GGUF (e.g. ``"▁the"``, ``"Ġthe"``, ``"<0x0A>"``)."""
        return self._tokens[self._check_id(tid)]

    def max_piece_chars(self) -> int:
        """An upper bound on the characters of text one token covers: the longest vocabulary
        spelling plus one (a prefix space). A spelling is never shorter than its text ("▁",
        "Ġ" and "<0x0A>" stand for one character), so a text of n characters has at least
        n / max_piece_chars() tokens. Computed once."""
        if self._max_piece_chars is None:
            self._max_piece_chars = max((len(t) for t in self._tokens), default=0) + 1
        return self._max_piece_chars

    def token_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled exactly ``text`` (GGUF spelling), or None."""
        return self._token_to_id.get(text)

    def token_attr(self, tid: int) -> int:
        """llama.cpp token attribute bits (``ATTR_*``) of ``tid``."""
        return self._attrs[self._check_id(tid)]

    def token_score(self, tid: int) -> float:
        """The ``tokenizer.ggml.scores`` entry of ``tid`` (0.0 when the GGUF has none)."""
        return self._scores[self._check_id(tid)]

    def is_eog(self, tid: int) -> bool:
        """True if ``tid`` ends generation (EOS, EOT, EOM and the tokens llama.cpp detects by text)."""
        return tid in self.eog_ids

    def is_control(self, tid: int) -> bool:
        """True for CONTROL tokens (rendered only with ``special=True``)."""
        return bool(self.token_attr(tid) & ATTR_CONTROL)

    # -------------------------------------------------------------- tokenizing

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids, as llama.cpp ``llama_tokenize`` gives them.

        ``add_special``: prepend BOS / append EOS where the vocabulary asks for them
        (``add_bos`` / ``add_eos``). ``parse_special``: recognise CONTROL tokens
        (e.g. ``<start_of_turn>``) written in the text; USER_DEFINED tokens are
        recognised either way. Returns a list of ints in ``[0, n_vocab)``.
        Raises :class:`TokenizerError` if ``text`` is not a str or the vocabulary
        cannot encode it (no byte fallback token).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text to tokenize must be a str, got {type(text).__name__}")
        if self.vocab_type == "none":
            raise TokenizerError("this model has no vocabulary (tokenizer.ggml.model = 'none')")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates -> U+FFFD
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        out: list[int] = []
        frags = self._partition(text, parse_special) if text else []
        if self.vocab_type == "spm":
            if add_special and self.add_bos:
                out.append(self.bos_id)
            prev_special = True
            for frag in frags:
                if isinstance(frag, str):
                    if self.add_space_prefix and prev_special:
                        frag = " " + frag
                    self._tokenize_spm(frag.replace(" ", SPACE_ESCAPE), out)
                    prev_special = False
                else:
                    out.append(frag)
                    prev_special = True
            if add_special and self.add_eos:
                out.append(self.eos_id)
        else:
            if add_special and self.add_bos:
                out.append(self.bos_id)
            for frag in frags:
                if isinstance(frag, str):
                    if self.escape_whitespaces:
                        frag = frag.replace(" ", SPACE_ESCAPE)
                    if self.model == "whitespace":
                        self._tokenize_whitespace(frag, out)
                    else:
                        self._tokenize_bpe(frag, out)
                else:
                    out.append(frag)
            if add_special and self.add_eos:
                out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list:
        """Cut special tokens out of ``text``: a list of str fragments and int token ids.

        llama-vocab.cpp ``tokenizer_st_partition``: for each special token, longest
        first, every occurrence inside the remaining text fragments is replaced,
        honouring the token's LSTRIP / RSTRIP attributes (strip C-locale spaces).
        """
        toks = self._tokens
        attrs = self._attrs
        skip = 0 if parse_special else (ATTR_CONTROL | ATTR_UNKNOWN)
        cands = []
        for key, group in self._special_groups.items():
            if key in text:
                for tid in group:
                    if not attrs[tid] & skip and toks[tid] in text:
                        cands.append(tid)
        if not cands:
            return [text]
        rank = self._special_rank
        cands.sort(key=rank.__getitem__)
        frags: list = [text]
        for tid in cands:
            tok = toks[tid]
            attr = attrs[tid]
            lstrip = attr & ATTR_LSTRIP
            rstrip = attr & ATTR_RSTRIP
            ntok = len(tok)
            new: list = []
            for frag in frags:
                if not isinstance(frag, str) or tok not in frag:
                    new.append(frag)
                    continue
                pos = 0
                end = len(frag)
                while True:
                    m = frag.find(tok, pos)
                    if m < 0:
                        break
                    left = frag[pos:m]
                    if lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        new.append(left)
                    new.append(tid)
                    pos = m + ntok
                    if rstrip:
                        while pos < end and frag[pos] in _C_SPACE:
                            pos += 1
                if pos < end:
                    new.append(frag[pos:])
            frags = new
        return frags

    def _byte_token(self, b: int) -> int | None:
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._token_to_id.get(chr(b))
        return tid

    def _tokenize_spm(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize on an already escaped fragment.

        Symbols are the code points; the queue pops the highest-scoring adjacent
        pair that is a token (ties: leftmost), merges it and queues the new
        neighbours. O(n log n) in the fragment length.
        """
        syms = list(text)
        n = len(syms)
        if n == 0:
            return
        t2i = self._token_to_id
        scores = self._scores
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            s = syms[i] + syms[i + 1]
            tid = t2i.get(s)
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, len(s)))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, l, r, size = pop(heap)
            sl = syms[l]
            sr = syms[r]
            if not sl or not sr or len(sl) + len(sr) != size:
                continue
            merged = sl + sr
            syms[l] = merged
            syms[r] = ""
            rn = nxt[r]
            nxt[l] = rn
            if rn >= 0:
                prv[rn] = l
            lp = prv[l]
            if lp >= 0:
                s = syms[lp] + merged
                tid = t2i.get(s)
                if tid is not None:
                    push(heap, (-scores[tid], lp, l, len(s)))
            if rn >= 0:
                s = merged + syms[rn]
                tid = t2i.get(s)
                if tid is not None:
                    push(heap, (-scores[tid], l, rn, len(s)))
        i = 0
        while i != -1:
            s = syms[i]
            tid = t2i.get(s)
            if tid is not None:
                out.append(tid)
            else:
                for b in s.encode("utf-8"):
                    bt = self._byte_token(b)
                    if bt is None:
                        bt = self.unk_id
                    if bt is None:
                        raise TokenizerError(f"vocabulary has no byte token for 0x{b:02X} and no unknown token")
                    out.append(bt)
            i = nxt[i]

    def _tokenize_bpe(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_bpe_session::tokenize: pre-tokenize, then merge each word (cached)."""
        cache = self._bpe_cache
        words = pt.regex_split(text, self._regexes)
        if self.pre_type == "mmbert":
            words = _metaspace_words(words)
        enc = pt.byte_encode if self._byte_encode else None
        for w in words:
            if enc is not None:
                w = enc(w)
            ids = cache.get(w)
            if ids is None:
                ids = self._bpe_word(w)
                if len(cache) >= _BPE_CACHE_MAX:
                    cache.clear()
                cache[w] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        if not word:
            return ()
        t2i = self._token_to_id
        if self.ignore_merges:
            tid = t2i.get(word)
            if tid is not None:
                return (tid,)
        if self.pre_type in ("gemma4", "mmbert") and not word.strip("\n"):
            tid = t2i.get(word)
            if tid is not None:
                return (tid,)
        ranks = self._bpe_ranks
        syms = list(word)
        n = len(syms)
        if n > 1:
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prv = list(range(-1, n - 1))
            heap = []
            for i in range(n - 1):
                a, b = syms[i], syms[i + 1]
                rank = ranks.get(a + " " + b)
                if rank is not None:
                    heap.append((rank, i, i + 1, a + b))
            heapq.heapify(heap)
            pop, push = heapq.heappop, heapq.heappush
            while heap:
                _, l, r, text = pop(heap)
                sl = syms[l]
                sr = syms[r]
                if not sl or not sr or sl + sr != text:
                    continue
                syms[l] = text
                syms[r] = ""
                rn = nxt[r]
                nxt[l] = rn
                if rn >= 0:
                    prv[rn] = l
                lp = prv[l]
                if lp >= 0:
                    a = syms[lp]
                    rank = ranks.get(a + " " + text)
                    if rank is not None:
                        push(heap, (rank, lp, l, a + text))
                if rn >= 0:
                    b = syms[rn]
                    rank = ranks.get(text + " " + b)
                    if rank is not None:
                        push(heap, (rank, l, rn, text + b))
        res: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = t2i.get(s)
            if tid is not None:
                res.append(tid)
                continue
            for b in s.encode("utf-8"):
                if self._byte_encode:
                    bt = t2i.get(chr(b)) if b < 0x80 else None
                else:
                    bt = t2i.get(f"<0x{b:02X}>")
                if bt is not None:
                    res.append(bt)
        return tuple(res)

    def _tokenize_whitespace(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_whitespace_session: BPE per whitespace-separated segment, whitespace dropped."""
        seg: list[str] = []
        for ch in text:
            if pt.is_whitespace(ch):
                if seg:
                    self._tokenize_bpe("".join(seg), out)
                    seg = []
            else:
                seg.append(ch.lower()[0] if self.lowercase else ch)  # simple lowercase mapping
        if seg:
            self._tokenize_bpe("".join(seg), out)

    # ------------------------------------------------------------- detokenizing

    def _piece(self, tid: int) -> bytes:
        piece = self._piece_cache.get(tid)
        if piece is not None:
            return piece
        text = self._tokens[tid]
        attr = self._attrs[tid]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            piece = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            if self.vocab_type == "spm" or self.escape_whitespaces:
                piece = text.replace(SPACE_ESCAPE, " ").encode("utf-8")
            else:
                piece = _decode_byte_alphabet(text)
        elif attr & ATTR_BYTE:
            try:
                piece = bytes((int(text[3:5], 16),))
            except ValueError:
                piece = b""
        else:
            piece = b""
        self._piece_cache[tid] = piece
        return piece

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """The bytes token ``tid`` stands for (llama.cpp ``llama_token_to_piece``, lstrip 0).

        A byte token gives its single raw byte, so a piece may be an incomplete
        UTF-8 sequence. CONTROL and UNKNOWN tokens give their text only with
        ``special=True``, else ``b""``. Raises :class:`TokenizerError` for an id out of range.
        """
        tid = self._check_id(tid)
        if not special and self._attrs[tid] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._piece(tid)

    def detokenize_bytes(self, ids: Iterable[int], special: bool = False, remove_special: bool = False) -> bytes:
        """Token ids to bytes, as llama.cpp ``llama_detokenize`` (see :meth:`detokenize`)."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        buf = bytearray()
        for tid in ids:
            piece = self.token_to_piece(tid, special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            buf += piece
        if self.clean_spaces and buf:
            buf = bytearray(_CLEAN_PASS1.sub(b"", bytes(buf)))
            if b" '" in buf:
                buf = _clean_pass_quotes(buf)
        return bytes(buf)

    def detokenize(self, ids: Sequence[int], special: bool = False, remove_special: bool = False) -> str:
        """Token ids to text, as llama.cpp ``common_detokenize`` / ``llama_detokenize``.

        ``special``: render CONTROL tokens' text. ``remove_special``: drop a leading
        BOS / trailing EOS the vocabulary adds. The SPM prefix space is removed from
        the first token's piece (when ``add_space_prefix``); BPE vocabularies apply
        llama.cpp's space clean-up (" ," -> ","; " 's" -> "'s"; ...) unless the
        pre-tokenizer disables it. Invalid UTF-8 becomes U+FFFD.
        """
        return self.detokenize_bytes(ids, special, remove_special).decode("utf-8", errors="replace")


def _metaspace_words(words: list[str]) -> list[str]:
    """mmBERT's Metaspace split (llm_tokenizer_bpe_session::tokenize): every word
    but newline runs starts with ``▁`` and is cut before each further ``▁``."""
    out: list[str] = []
    for w in words:
        if not w.strip("\n"):
            out.append(w)
            continue
        if not w.startswith(SPACE_ESCAPE):
            w = SPACE_ESCAPE + w
        start = 0
        n = len(w)
        while start < n:
            end = w.find(SPACE_ESCAPE, start + 1)
            if end < 0:
                end = n
            out.append(w[start:end])
            start = end
    return out


def _decode_byte_alphabet(text: str) -> bytes:
    """llama.cpp llama_decode_text: GPT-2 byte-alphabet chars back to bytes."""
    out = bytearray()
    u2b = pt.UNICODE_TO_BYTE
    for ch in text:
        b = u2b.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


class StreamDecoder:
    """Incremental detokenizer for streaming: never emits part of a UTF-8 sequence.

    ``feed(id)`` appends the token's piece (``Tokenizer.token_to_piece(id, special)``)
    and returns the text completed so far; bytes of an unfinished character stay
    buffered until a later piece completes them. Invalid bytes become U+FFFD.
    ``flush()`` returns what is left (an unfinished sequence as U+FFFD) and resets.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        return self._dec.decode(self._tok.token_to_piece(token_id, self._special))

    def flush(self) -> str:
        """Return any buffered bytes (incomplete ones as U+FFFD) and reset."""
        s = self._dec.decode(b"", final=True)
        self._dec.reset()
        return s

"""HF checkpoint -> GGUF for Qwen3.5 text models (`Qwen3_5ForCausalLM`, and the language model of
`Qwen3_5ForConditionalGeneration`), writing llama.cpp's `qwen35` layout.

What llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`,
`Qwen3_5TextModel`) does, and so what we do:
- tensor names: `token_embd`, `output_norm`, `output`, `blk.N.{attn_norm, post_attention_norm,
  attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, attn_qkv, attn_gate, ssm_conv1d,
  ssm_a, ssm_dt.bias, ssm_alpha, ssm_beta, ssm_norm, ssm_out, ffn_gate, ffn_up, ffn_down}`;
- zero-centred RMSNorm weights are stored as `1 + w` (every `*norm.weight` except the DeltaNet
  output norm `linear_attn.norm`, which HF applies as a plain weight);
- `ssm_a = -exp(A_log)`; the conv weight [C, 1, K] is squeezed to [C, K];
- V heads are reordered from HF's grouped order (v-head `k·r + j` belongs to k-head k) to ggml's
  tiled order (stored at `j·n_k + k`), so v-head h reads k-head `h % n_k`: the v rows of
  `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`, the v
  channels of the conv, and the input columns of `out_proj`;
- types: 1-D tensors, norms, the conv weight and non-`.weight` tensors stay F32; other matrices
  take the outtype; Q8_0 falls back to F16 for rows not a multiple of 32 (as gguf-py's QuantError);
- metadata: `qwen35.*` hyperparameters (with `rope.dimension_sections` padded to 4, default
  [11, 11, 10, 0]; `attention.recurrent_layers` from `layer_types`), `general.*`, and the GPT-2 BPE
  tokenizer (`tokenizer.ggml.model = gpt2`, `pre = qwen35`, tokens, types, merges, special ids,
  add_*_token flags following gguf-py's `SpecialVocab`, `tokenizer.chat_template`).

Deliberate differences: `tokenizer.ggml.pre` is always `qwen35` (llama.cpp picks it by hashing the
tokenizer's output on a test string, which only works for the released tokenizers); an
`eot_token_id` for `<|im_end|>` is added when that token exists (llama.cpp would find the same id
by name); the MTP block (`mtp.*`) and vision tower are not exported. Safetensors are read with our own
bounds-checked parser (numpy cannot read bf16 through the safetensors package without torch).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT

from daemons.gguf_writer import TensorData, Typed, write_gguf

__all__ = ["ConvertError", "ConvertResult", "OUTTYPES", "convert_hf_to_gguf", "convert_dflash_to_gguf", "read_safetensors",
           "v_heads_grouped_to_tiled", "v_heads_tiled_to_grouped"]

ARCH = "qwen35"
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
OUTTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}     # llama.cpp LlamaFileType
_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
GGML_QUANT_VERSION = 2

# gguf TokenType
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
# SpecialVocab's special token kinds and the GGUF keys llama.cpp's writer has for them ("cls" has none).
_SPECIAL_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                 "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
                 "pad": "tokenizer.ggml.padding_token_id", "cls": None,
                 "mask": "tokenizer.ggml.mask_token_id"}
_ADD_KEYS = {"bos": "tokenizer.ggml.add_bos_token", "eos": "tokenizer.ggml.add_eos_token",
             "sep": "tokenizer.ggml.add_sep_token"}


class ConvertError(ValueError):
    """The input cannot be converted (wrong architecture, missing or malformed files). One line."""


@dataclass(frozen=True)
class ConvertResult:
    path: str
    outtype: str
    n_tensors: int
    n_params: int
    n_vocab: int


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class _SafetensorsFile:
    """One memory-mapped .safetensors file: header parsed and bounds-checked, tensors read lazily."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 8:
                    raise ConvertError(f"{path}: not a safetensors file ({size} bytes)")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ConvertError(f"{path}: cannot read: {e.strerror}") from None
        (n,) = struct.unpack_from("<Q", self._map, 0)
        if n > size - 8 or n > 100 << 20:
            raise ConvertError(f"{path}: safetensors header length {n} is invalid")
        try:
            header = json.loads(bytes(self._map[8:8 + n]))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConvertError(f"{path}: safetensors header is not valid JSON") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start, self.data_size = 8 + n, size - 8 - n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype, shape, (b0, b1) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ConvertError(f"{path}: malformed header entry for '{name}'") from None
            if not 0 <= b0 <= b1 <= self.data_size:
                raise ConvertError(f"{path}: tensor '{name}' data lies outside the file")
            self.entries[name] = (dtype, shape, int(b0), int(b1))

    def raw(self, name: str) -> tuple[str, tuple[int, ...], np.ndarray, int]:
        """(dtype, shape, the stored bytes as a read-only uint8 view into the map, file offset) of a
        tensor, checked for a consistent byte count; F32, F16 and BF16 only (GGUF has those types)."""
        dtype, shape, b0, b1 = self.entries[name]
        size = {"F32": 4, "F16": 2, "BF16": 2}.get(dtype)
        if size is None:
            raise ConvertError(f"{self.path}: tensor '{name}' has dtype {dtype}; only F32, F16 and BF16 are "
                               f"supported here")
        if math.prod(shape) * size != b1 - b0:
            raise ConvertError(f"{self.path}: tensor '{name}' of {dtype}{list(shape)} has {b1 - b0} bytes")
        view = np.frombuffer(self._map, dtype=np.uint8, count=b1 - b0, offset=self.data_start + b0)
        return dtype, shape, view, self.data_start + b0

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (a copy)."""
        dtype, shape, b0, b1 = self.entries[name]
        np_dtype = _ST_DTYPES.get(dtype)
        if np_dtype is None:
            raise ConvertError(f"{self.path}: tensor '{name}' has dtype {dtype}; only F32, F16, BF16 and F64 "
                               f"checkpoints can be converted")
        count = math.prod(shape)
        if count * np.dtype(np_dtype).itemsize != b1 - b0:
            raise ConvertError(f"{self.path}: tensor '{name}' of {dtype}{list(shape)} has {b1 - b0} bytes")
        raw = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=self.data_start + b0)
        if dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return raw.astype(np.float32).reshape(shape)


def read_safetensors(hf_dir: str | os.PathLike) -> dict[str, tuple[_SafetensorsFile, str]]:
    """name -> (file, name) for every tensor of the checkpoint in `hf_dir` (sharded or not)."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ConvertError(f"{index}: not a valid safetensors index (needs a 'weight_map')") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{d}: no *.safetensors files (other checkpoint formats are not supported)")
    out: dict[str, tuple[_SafetensorsFile, str]] = {}
    for fn in files:
        p = d / fn
        if not p.is_file():
            raise ConvertError(f"{p}: listed in the safetensors index but missing")
        st = _SafetensorsFile(p)
        for name in st.entries:
            if name in out:
                raise ConvertError(f"{p}: tensor '{name}' appears in more than one file")
            out[name] = (st, name)
    return out


# ------------------------------------------------------------------------------------------------
# V-head reordering
# ------------------------------------------------------------------------------------------------

def _swap_head_axes(x: np.ndarray, axis: int, a: int, b: int, head_dim: int) -> np.ndarray:
    x = np.asarray(x)
    axis = axis % x.ndim
    if x.shape[axis] != a * b * head_dim:
        raise ConvertError(f"cannot reorder V heads: axis {axis} has {x.shape[axis]} entries, "
                           f"expected {a}·{b}·{head_dim}")
    shp = x.shape[:axis] + (a, b, head_dim) + x.shape[axis + 1:]
    y = np.swapaxes(x.reshape(shp), axis, axis + 1)
    return np.ascontiguousarray(y).reshape(x.shape)


def v_heads_grouped_to_tiled(x: np.ndarray, axis: int, n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """HF grouped order (v-head k·r + j, r = n_v/n_k) -> ggml tiled order (j·n_k + k) along `axis`."""
    return _swap_head_axes(x, axis, n_k_heads, n_v_heads // n_k_heads, head_dim)


def v_heads_tiled_to_grouped(x: np.ndarray, axis: int, n_k_heads: int, n_v_heads: int, head_dim: int) -> np.ndarray:
    """Inverse of `v_heads_grouped_to_tiled`."""
    return _swap_head_axes(x, axis, n_v_heads // n_k_heads, n_k_heads, head_dim)


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConvertError(f"{path}: missing ({what} is required)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot parse {what}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: {what} is not a JSON object")
    return data


@dataclass(frozen=True)
class _Text:
    """The text-model hyperparameters the conversion needs, validated."""

    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    n_rot: int
    mrope_section: list[int]
    layer_types: list[str]
    full_attention_interval: int
    conv_kernel: int
    d_k: int
    d_v: int
    n_k_heads: int
    n_v_heads: int
    vocab_size: int
    context_length: int


def _text_config(config: dict, path: Path) -> _Text:
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None:
        mt = config.get("model_type")
        arch = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration"}.get(mt, mt)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(f"{path}: architecture {arch!r} is not supported (supported: "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    text = config.get("text_config")
    hp = {**config, **text} if isinstance(text, dict) else dict(config)

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        v = hp.get(key, default)
        if v is None:
            raise ConvertError(f"{path}: missing '{key}'")
        if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConvertError(f"{path}: '{key}' must be a positive integer, got {v!r}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise ConvertError(f"{path}: '{key}' must be a positive number, got {v!r}")
        return v

    if hp.get("attention_bias"):
        raise ConvertError(f"{path}: attention_bias = true is not supported by the qwen35 layout")
    if hp.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"{path}: hidden_act {hp.get('hidden_act')!r} is not supported (qwen35 uses silu)")
    n_embd, n_head = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim", n_embd // n_head)
    n_layer = get("num_hidden_layers")
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConvertError(f"{path}: rope_parameters must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ConvertError(f"{path}: rope type {rope_type!r} is not supported (only unscaled RoPE)")
    theta = rope.get("rope_theta", hp.get("rope_theta"))
    if theta is None:
        raise ConvertError(f"{path}: missing 'rope_theta'")
    partial = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.25))
    n_rot = int(head_dim * partial)
    if n_rot < 2 or n_rot % 2 or n_rot > head_dim:
        raise ConvertError(f"{path}: partial_rotary_factor {partial} gives {n_rot} rotary dims of {head_dim}")
    section = list(rope.get("mrope_section") or _DEFAULT_MROPE_SECTION)
    section = (section + [0] * 4)[:4]
    interval = hp.get("full_attention_interval", 4)
    layer_types = hp.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layer)]
    if len(layer_types) != n_layer or any(t not in ("linear_attention", "full_attention") for t in layer_types):
        raise ConvertError(f"{path}: layer_types must list {n_layer} entries of 'linear_attention' / 'full_attention'")
    n_k, n_v = get("linear_num_key_heads"), get("linear_num_value_heads")
    if n_v % n_k:
        raise ConvertError(f"{path}: linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}")
    n_head_kv = get("num_key_value_heads", n_head)
    if n_head % n_head_kv:
        raise ConvertError(f"{path}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}")
    return _Text(
        n_embd=n_embd, n_ff=get("intermediate_size"), n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, rms_eps=float(get("rms_norm_eps", 1e-6, float)), rope_theta=float(theta),
        n_rot=n_rot, mrope_section=[int(s) for s in section], layer_types=list(layer_types),
        full_attention_interval=int(interval), conv_kernel=get("linear_conv_kernel_dim", 4),
        d_k=get("linear_key_head_dim"), d_v=get("linear_value_head_dim"), n_k_heads=n_k, n_v_heads=n_v,
        vocab_size=get("vocab_size"), context_length=get("max_position_embeddings", 262144))


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------

def _looks_special(token: str) -> bool:
    # gguf-py's `does_token_look_special`: some checkpoints mark control tokens as not special.
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _tokenizer_metadata(hf_dir: Path, config: dict, vocab_size: int) -> dict[str, Any]:
    tok_path = hf_dir / "tokenizer.json"
    tok = _read_json(tok_path, "tokenizer.json")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConvertError(f"{tok_path}: only byte-level BPE tokenizers are supported (model.type is "
                           f"{model.get('type')!r})")
    vocab: dict[str, int] = dict(model["vocab"])
    added = [a for a in tok.get("added_tokens") or [] if isinstance(a, dict) and "content" in a and "id" in a]
    added_by_content = {a["content"]: a for a in added}
    for a in added:
        vocab[a["content"]] = int(a["id"])
    max_id = max(vocab.values(), default=-1)
    if max_id >= vocab_size:
        raise ConvertError(f"{tok_path}: token id {max_id} does not fit the model's vocab_size {vocab_size}")
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        t = reverse.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif t in added_by_content:
            tokens.append(t)
            types.append(TOKEN_CONTROL if added_by_content[t].get("special") or _looks_special(t)
                         else TOKEN_USER_DEFINED)
        else:
            tokens.append(t)
            types.append(TOKEN_NORMAL)

    merges_raw = model.get("merges") or []
    if not merges_raw:
        raise ConvertError(f"{tok_path}: the BPE model has no merges")
    if isinstance(merges_raw[0], str):
        merges = list(merges_raw)
    else:
        # transformers >= 4.45 pair format; spaces inside a part are written as U+0120 + 256 like gguf-py.
        merges = [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair)
                  for pair in merges_raw]

    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen35",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(types, _vt("ARRAY"), _vt("INT32")),
        "tokenizer.ggml.merges": Typed(merges, _vt("ARRAY"), _vt("STRING")),
    }

    # Special ids and add_*_token, in gguf-py SpecialVocab's order of precedence.
    tc_path = hf_dir / "tokenizer_config.json"
    tc = _read_json(tc_path, "tokenizer_config.json") if tc_path.is_file() else {}
    special: dict[str, int] = {}
    add: dict[str, bool] = {}
    post = tok.get("post_processor") or {}
    for proc in post.get("processors", [post]) if isinstance(post, dict) else []:
        kind = proc.get("type") if isinstance(proc, dict) else None
        if kind == "ByteLevel":
            add.setdefault("bos", False)
            add.setdefault("eos", False)
        elif kind == "TemplateProcessing":
            single = proc.get("single") or []
            if len(single) > 1:
                add["bos"] = "SpecialToken" in single[0]
                add["eos"] = "SpecialToken" in single[-1]
    for kind in _SPECIAL_KEYS:
        flag = tc.get(f"add_{kind}_token")
        if isinstance(flag, bool) and kind not in add:
            add[kind] = flag
        entry = tc.get(f"{kind}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str) and content in added_by_content:
            special.setdefault(kind, int(added_by_content[content]["id"]))
    cfg_text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for kind in _SPECIAL_KEYS:
        tid = config.get(f"{kind}_token_id", cfg_text.get(f"{kind}_token_id"))
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < vocab_size:
            special.setdefault(kind, tid)
    for kind, tid in special.items():
        if _SPECIAL_KEYS[kind]:
            md[_SPECIAL_KEYS[kind]] = tid
    if "<|im_end|>" in added_by_content:
        md["tokenizer.ggml.eot_token_id"] = int(added_by_content["<|im_end|>"]["id"])
    for kind, flag in add.items():
        if kind in _ADD_KEYS:
            md[_ADD_KEYS[kind]] = bool(flag)

    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif template is None and (hf_dir / "chat_template.json").is_file():
        template = _read_json(hf_dir / "chat_template.json", "chat_template.json").get("chat_template")
    if isinstance(template, list):   # named templates: keep the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        md["tokenizer.chat_template"] = template
    return md


def _vt(name: str):
    from gguf import GGUFValueType
    return getattr(GGUFValueType, name)


# ------------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_TOP_MAP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
# HF zero-centred norms (stored as 1 + w); `linear_attn.norm` is a plain weight and is not here.
_SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight")


def _hf_text_name(name: str) -> str | None:
    """The Qwen3_5ForCausalLM name of a checkpoint tensor, or None for tensors we do not export
    (vision tower, MTP block)."""
    if name.startswith(("mtp.", "model.mtp.", "model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _transform(name: str, x: np.ndarray, cfg: _Text) -> tuple[str, np.ndarray]:
    """(gguf name, data in numpy shape) for one HF text tensor (already float32)."""
    if name in _TOP_MAP:
        if name == "model.norm.weight":
            x = x + 1.0
        return _TOP_MAP[name], x
    m = _LAYER.match(name)
    if not m or m.group(2) not in _LAYER_MAP:
        raise ConvertError(f"unexpected tensor '{name}' in a Qwen3_5 checkpoint")
    il, rest = int(m.group(1)), m.group(2)
    if il >= cfg.n_layer:
        raise ConvertError(f"tensor '{name}' belongs to layer {il}, but num_hidden_layers is {cfg.n_layer}")
    out = f"blk.{il}.{_LAYER_MAP[rest]}"
    nk, nv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.d_k, cfg.d_v
    if rest in _SHIFTED_NORMS:
        x = x + 1.0
    elif rest == "linear_attn.in_proj_qkv.weight":
        qk = 2 * nk * dk
        x = np.concatenate([x[:qk], v_heads_grouped_to_tiled(x[qk:], 0, nk, nv, dv)], axis=0)
    elif rest == "linear_attn.in_proj_z.weight":
        x = v_heads_grouped_to_tiled(x, 0, nk, nv, dv)
    elif rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.dt_bias"):
        x = v_heads_grouped_to_tiled(x, 0, nk, nv, 1)
    elif rest == "linear_attn.A_log":
        x = -np.exp(v_heads_grouped_to_tiled(x, 0, nk, nv, 1))
    elif rest == "linear_attn.conv1d.weight":
        x = x.reshape(x.shape[0], x.shape[-1])                   # [C, 1, K] -> [C, K]
        qk = 2 * nk * dk
        x = np.concatenate([x[:qk], v_heads_grouped_to_tiled(x[qk:], 0, nk, nv, dv)], axis=0)
    elif rest == "linear_attn.out_proj.weight":
        x = v_heads_grouped_to_tiled(x, 1, nk, nv, dv)
    return out, np.ascontiguousarray(x, dtype=np.float32)


def _storage_type(gguf_name: str, x: np.ndarray, outtype: QT) -> QT:
    """llama.cpp's rule: 1-D tensors, norms, the conv weight and non-`.weight` tensors are F32."""
    if x.ndim <= 1 or gguf_name.endswith("_norm.weight") or ".ssm_conv1d." in gguf_name \
            or not gguf_name.endswith(".weight"):
        return QT.F32
    if outtype == QT.Q8_0 and x.shape[-1] % 32:
        return QT.F16
    return outtype


def _expected_shapes(cfg: _Text, with_output: bool) -> dict[str, tuple[int, ...]]:
    """gguf name -> numpy shape of every tensor the converted file must contain."""
    d, ff = cfg.n_embd, cfg.n_ff
    inner = cfg.n_v_heads * cfg.d_v
    C = 2 * cfg.n_k_heads * cfg.d_k + inner
    out = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if with_output:
        out["output.weight"] = (cfg.vocab_size, d)
    for il, kind in enumerate(cfg.layer_types):
        p = f"blk.{il}."
        out.update({p + "attn_norm.weight": (d,), p + "post_attention_norm.weight": (d,),
                    p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d), p + "ffn_down.weight": (d, ff)})
        if kind == "linear_attention":
            out.update({p + "attn_qkv.weight": (C, d), p + "attn_gate.weight": (inner, d),
                        p + "ssm_conv1d.weight": (C, cfg.conv_kernel), p + "ssm_a": (cfg.n_v_heads,),
                        p + "ssm_dt.bias": (cfg.n_v_heads,), p + "ssm_alpha.weight": (cfg.n_v_heads, d),
                        p + "ssm_beta.weight": (cfg.n_v_heads, d), p + "ssm_norm.weight": (cfg.d_v,),
                        p + "ssm_out.weight": (d, inner)})
        else:
            hd = cfg.head_dim
            out.update({p + "attn_q.weight": (2 * cfg.n_head * hd, d), p + "attn_k.weight": (cfg.n_head_kv * hd, d),
                        p + "attn_v.weight": (cfg.n_head_kv * hd, d), p + "attn_q_norm.weight": (hd,),
                        p + "attn_k_norm.weight": (hd,), p + "attn_output.weight": (d, cfg.n_head * hd)})
    return out


def _sort_key(name: str) -> tuple:
    m = re.match(r"^blk\.(\d+)\.", name)
    return (1, int(m.group(1)), name) if m else (0, 0, {"token_embd.weight": "0", "output_norm.weight": "1"}.get(name, name))


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------

def _write(out_path: str | os.PathLike, arch: str, md: dict[str, Any], arrays: dict[str, np.ndarray],
           outtype: str, *, n_vocab: int) -> ConvertResult:
    """Write `arrays` (GGUF name -> float array) in llama.cpp's order and storage types."""
    out = [TensorData(name, arrays[name], _storage_type(name, arrays[name], OUTTYPES[outtype]))
           for name in sorted(arrays, key=_sort_key)]
    out_path = Path(out_path)
    if out_path.parent and not out_path.parent.is_dir():
        raise ConvertError(f"{out_path.parent}: output directory does not exist")
    try:
        write_gguf(out_path, arch, md, out)
    except OSError as e:
        raise ConvertError(f"{out_path}: cannot write: {e.strerror}") from None
    return ConvertResult(path=str(out_path), outtype=outtype, n_tensors=len(out),
                         n_params=int(sum(t.data.size for t in out)), n_vocab=n_vocab)


def convert_hf_to_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
                       *, name: str | None = None) -> ConvertResult:
    """Convert the HF checkpoint in `hf_dir` (config.json, *.safetensors, tokenizer.json, and
    optionally tokenizer_config.json) to a qwen35 GGUF at `out_path`, matrices stored as
    `outtype` (f32, f16, bf16 or q8_0). Raises ConvertError with a one-line message."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConvertError(f"{d}: not a directory")
    outtype = str(outtype).lower()
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r} is not supported (choose from {', '.join(OUTTYPES)})")
    config = _read_json(d / "config.json", "config.json")
    cfg = _text_config(config, d / "config.json")
    tok_md = _tokenizer_metadata(d, config, cfg.vocab_size)

    tensors = read_safetensors(d)
    text_names = {n: t for n in tensors if (t := _hf_text_name(n)) is not None}
    # Like llama.cpp, write `output.weight` exactly when the checkpoint has an lm_head (HF omits it
    # for tied embeddings); the loader falls back to token_embd without it.
    expected = _expected_shapes(cfg, with_output="lm_head.weight" in text_names.values())
    produced: dict[str, np.ndarray] = {}
    for hf_name, text_name in text_names.items():
        st, key = tensors[hf_name]
        gname, data = _transform(text_name, st.load(key), cfg)
        want = expected.get(gname)
        if want is None:
            raise ConvertError(f"tensor '{hf_name}' ({gname}) does not belong to layer type "
                               f"'{cfg.layer_types[int(gname.split('.')[1])] if gname.startswith('blk.') else '?'}'")
        if data.shape != want:
            raise ConvertError(f"tensor '{hf_name}' has shape {list(data.shape)}, expected {list(want)} from config.json")
        if gname in produced:
            raise ConvertError(f"tensor '{gname}' produced twice (from '{hf_name}')")
        produced[gname] = data
    missing = sorted(set(expected) - set(produced), key=_sort_key)
    if missing:
        raise ConvertError(f"{d}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. '{missing[0]}'")

    a = ARCH
    md: dict[str, Any] = {
        "general.type": "model",
        "general.name": name or d.resolve().name,
        "general.quantization_version": GGML_QUANT_VERSION,
        "general.file_type": _FILE_TYPE[outtype],
        f"{a}.block_count": cfg.n_layer,
        f"{a}.context_length": cfg.context_length,
        f"{a}.embedding_length": cfg.n_embd,
        f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.rope.dimension_sections": Typed(cfg.mrope_section, _vt("ARRAY"), _vt("INT32")),
        f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.ssm.conv_kernel": cfg.conv_kernel,
        f"{a}.ssm.state_size": cfg.d_k,
        f"{a}.ssm.group_count": cfg.n_k_heads,
        f"{a}.ssm.time_step_rank": cfg.n_v_heads,
        f"{a}.ssm.inner_size": cfg.d_v * cfg.n_v_heads,
        f"{a}.attention.recurrent_layers": Typed([t == "linear_attention" for t in cfg.layer_types],
                                                 _vt("ARRAY"), _vt("BOOL")),
        f"{a}.full_attention_interval": cfg.full_attention_interval,
        f"{a}.rope.dimension_count": cfg.n_rot,
        **tok_md,
    }
    return _write(out_path, ARCH, md, produced, outtype, n_vocab=cfg.vocab_size)



# ------------------------------------------------------------------------------------------------
# DFlash drafts
# ------------------------------------------------------------------------------------------------

def convert_dflash_to_gguf(zlab_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
                           *, target_gguf: str | os.PathLike | None = None, name: str | None = None) -> ConvertResult:
    """Convert a z-lab DFlash draft directory (config.json + *.safetensors, `DFlashDraftModel`) to a
    GGUF in llama.cpp's `dflash` layout (what llama.cpp's `convert_hf_to_gguf.py` writes for these
    drafts): `dflash.*` hyperparameters, `dflash.block_size`, `dflash.target_layers` = HF layer id + 1,
    `tokenizer.ggml.mask_token_id`, optional causal / sliding-window / logit-scale keys; tensors `fc`,
    `enc.output_norm` (hidden_norm), `output_norm`, `blk.N.{attn_norm, attn_q, attn_k, attn_v,
    attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down}`; norms F32, matrices
    `outtype`. The draft has no vocabulary of its own; with `target_gguf`, that file's `tokenizer.*`
    keys are copied in (llama.cpp wants a vocabulary to open a model). DFlash2 drafts are refused."""
    from daemons.dflash import DraftModelError, _check_tensors, _read_zlab
    d = Path(zlab_dir)
    if not d.is_dir():
        raise ConvertError(f"{d}: not a directory (a z-lab DFlash draft directory holds config.json and *.safetensors)")
    outtype = str(outtype).lower()
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r} is not supported (choose from {', '.join(OUTTYPES)})")
    try:
        cfg, tensors = _read_zlab(d)
        _check_tensors(cfg, tensors)
    except DraftModelError as e:
        raise ConvertError(str(e)) from None
    a = "dflash"
    assert cfg.target_layer_ids is not None                  # z-lab configs always name them
    md: dict[str, Any] = {
        "general.type": "model",
        "general.name": name or d.resolve().name,
        "general.quantization_version": GGML_QUANT_VERSION,
        "general.file_type": _FILE_TYPE[outtype],
        f"{a}.block_count": cfg.n_layer,
        f"{a}.context_length": 0,
        f"{a}.embedding_length": cfg.n_embd,
        f"{a}.feed_forward_length": cfg.n_ff,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_head_kv,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps,
        f"{a}.block_size": cfg.block_size,
        f"{a}.target_layers": Typed([i + 1 for i in cfg.target_layer_ids], _vt("ARRAY"), _vt("INT32")),
        "tokenizer.ggml.mask_token_id": cfg.mask_token_id,
    }
    config = _read_json(d / "config.json", "config.json")
    if isinstance(config.get("max_position_embeddings"), int):
        md[f"{a}.context_length"] = config["max_position_embeddings"]
    if cfg.n_rot != cfg.head_dim:
        md[f"{a}.rope.dimension_count"] = cfg.n_rot
    if cfg.causal_layers != cfg.swa_layers:           # the loaders' default: causal exactly on SWA layers
        if len(set(cfg.causal_layers)) != 1:
            raise ConvertError(f"{d}: per-layer causal flags {list(cfg.causal_layers)} have no GGUF key "
                               f"(llama.cpp has one attention.causal for all layers)")
        md[f"{a}.attention.causal"] = Typed(bool(cfg.causal_layers[0]), _vt("BOOL"))
    if any(cfg.swa_layers):
        md[f"{a}.attention.sliding_window"] = int(cfg.sliding_window or 0)
        md[f"{a}.attention.sliding_window_pattern"] = Typed(list(cfg.swa_layers), _vt("ARRAY"), _vt("BOOL"))
    if cfg.logit_scale != 1.0:
        md[f"{a}.logit_scale"] = cfg.logit_scale
    if cfg.logit_softcap > 0:
        md[f"{a}.final_logit_softcapping"] = cfg.logit_softcap
    if cfg.embedding_scale != 1.0:
        md[f"{a}.embedding_scale"] = cfg.embedding_scale
    if target_gguf is not None:
        from gguf import GGUFValueType

        from daemons.gguf_reader import GGUFError, GGUFFile
        try:
            with GGUFFile(target_gguf) as t:
                for key, value in t.metadata.items():
                    entry = t.metadata_entry(key)
                    if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id" and entry is not None:
                        md[key] = Typed(value, GGUFValueType(entry.vtype),
                                        GGUFValueType(entry.item_type) if entry.item_type is not None else None)
        except GGUFError as e:
            raise ConvertError(str(e)) from None
    return _write(out_path, a, md, {name: t.dequantize() for name, t in tensors.items()}, outtype, n_vocab=0)

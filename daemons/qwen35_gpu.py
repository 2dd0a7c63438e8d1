"""The qwen35 forward on a GPU as prepared launches, one CUDA graph per step.

`Qwen35Model` (daemons/qwen35.py) hands `forward`, `prefill`, `verify` and `rollback` to a
`Qwen35GpuStep` when it runs on a GPU backend and every matrix has a tensor-core layout
(kernels/fused_gpu.py TC_TYPES: Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, F16). A step of T <= 32 tokens is, per
layer (see kernels/fused.cu and kernels/mma_matmul.cu for each kernel):

    DeltaNet   prep(attn_norm) -> mm[qkv | z | alpha | beta] -> gdn_conv -> gdn_recur -> gdn_out_prep
               -> mm[ssm_out] += x
    attention  prep(attn_norm) -> mm[q|gate, k, v] -> attn_qk_rope_kv -> attn_partial
               -> attn_combine_prep -> mm[attn_output] += x
    FFN        prep(post_attention_norm) -> mm[gate, up] with the SwiGLU epilogue -> mm[down] += x

where `+= x` adds into an int64 fixed-point accumulator beside x (no exchange between the blocks
that share rows) and the next prep folds it into x (`_Residual`: two x buffers, two accumulators);
the DeltaNet projections (qkv | z | alpha | beta) are fixed-point sums the same way, which gdn_conv
and gdn_out_prep read as floats; gdn_out_prep clears z as it reads it, gdn_conv the other DeltaNet
layer parity's qkv and alpha | beta (two buffers of each: a verify's conv blocks of tokens share rows).

then prep(output_norm) -> mm[output] -> argmax (or, for sampled decoding, the logits row left on
the device for `topk_row`, so that only the candidates the sampler needs cross to the host).
A launch holds matrices of at most two types (llama.cpp's Q4_K_M gives attn_qkv Q6_K in some layers
beside Q4_K z, alpha and beta: one launch whose grid is split between the two types, mm_tc_parts).
The launch list for each (T, mode, logits, captured layers, attention key splits) is built once
and captured as a CUDA graph (the
splits grow in powers of two with the context: `plan_key`); a step then writes the params block
(position, token ids), rebinds the state table if the state changed, launches the graph and reads
back token ids (and logits only when asked).

A forward of `backend.wide_batch_min` tokens or more (a prefill chunk) does not use the step:
daemons/qwen35.py runs it through the backend operations, whose matrix products are then cuBLAS
GEMMs on weights dequantised to f16 (kernels/cuda_backend.py `_wide_matmul`), compute-bound where
this step would read every weight again each 32 tokens. It writes the same state arrays in place.

Modes:
- advance (decode, prefill chunks): the conv and delta-rule states are updated in place.
- chain0 / chain1 (greedy decoding, `GreedyChain`): a one-token advance whose graph ends by writing
  the next step's params from its own argmax, so the host queues the next step before reading the
  token; the delta-rule states go from one buffer to the other (the state's arrays and `ssm_alt`)
  and gdn_conv keeps the conv state it replaces, so the step queued past the last token wanted is
  undone exactly.
- verify (speculative): nothing of the recurrent state is written; each DeltaNet layer keeps its
  block inputs (the raw q|k|v rows behind a copy of the conv state, the recurrence inputs) and a
  copy of the delta-rule state it read. `commit(n)` (rollback) then replays the first n tokens of
  the recurrence from that copy and rebuilds the conv state from the kept rows, for all layers in
  two launches: exact, because it runs the same recurrence on the same inputs, and repeatable (a
  later `commit` of a shorter prefix of the same block starts from the same copy). KV rows past the
  kept prefix stay in the cache, unread (attention is causal) and overwritten later.

Every row is computed the same way whatever T is (kernels/mma_matmul.cu "batch invariance"; the
attention split and the recurrence depend on a row's position only), so verify rows are
bit-identical to decode steps and greedy speculative output is token for token the greedy output.

The state arrays (`Qwen35State`) are used in place, never replaced: the engine reads pointers to
them from its state table, written when a different state object is bound.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import numpy as np

from kernels.fused_gpu import (GDN_CONV_TOKENS, MAX_T, MM_CHAIN_PREP, MODE_ADD, MODE_STORE, MODE_SWIGLU, TOPK_MAX,
                               ActBuffer, FusedGpu, MmWorkspace, Op, TcWeight, att_launch_splits)

__all__ = ["Qwen35GpuStep", "GreedyChain", "GpuVerifyRecord", "step_supported"]

# Benchmarks only (tests/bench/ab_bench.sh def:WIDE_SWIGLU_VARIANT=...): mm_tc variant defines for the
# gate|up launches of 9..24 rows, e.g. ("MM_GRID=3", "MM_STAGES=3"): three blocks a multiprocessor with a
# third pipeline stage, which four blocks' shared memory leaves no room for at these widths. Does a deeper
# ring shorten verify's widest launches? Any value but () gives those launches other stripes than decode's,
# so verify rows are then no longer decode's bits (the GPU tests fail): never a default.
WIDE_SWIGLU_VARIANT: tuple[str, ...] = ()
# A/B candidate (tests/bench/ab_bench.sh def:CHAIN_STEP=1, 2 or 3): a one-row step runs each run of adjacent
# launches that fused_gpu.op_mm_chain can take as one persistent launch: 1 the products (each layer's gate|up
# and ffn_down), 2 the products and the one-row norm preps between them (a layer's mixer output product,
# post-norm prep, gate|up, ffn_down, the next layer's attn-norm prep and its input products; the output norm
# and the output product), 3 also DeltaNet's conv, recurrence and gated norm (its layers whole: a chain from
# one attention layer's output product to the next one's input product). The same bits; each block requests
# the next product's first weights as it leaves one, and a small phase's blocks run it while the others wait
# with theirs requested.
CHAIN_STEP = 0


def step_supported(model: Any) -> bool:
    """True when `model`'s backend can run the fused step and all its matrices are tensor-core weights."""
    b = model.backend
    if not getattr(b, "supports_fused_step", False):
        return False
    mats = [model.output]
    for layer in model.layers:
        mats += [layer.ffn_gate, layer.ffn_up, layer.ffn_down]
        mats += [w for w in vars(layer.mixer).values() if hasattr(w, "n_out")]
    if not all(isinstance(w, TcWeight) for w in mats):
        return False
    # the SwiGLU launch pairs gate and up tile for tile: one type
    return all(layer.ffn_gate.qtype == layer.ffn_up.qtype for layer in model.layers)


@dataclass
class GpuVerifyRecord:
    """What `Qwen35GpuStep.verify` leaves for `rollback`: the block's start and length, and the
    engine generation its buffers belong to (the next verify reuses them)."""

    n_past0: int
    n_tokens: int
    generation: int
    state_id: int


class _StateError(ValueError):
    pass


class Qwen35GpuStep:
    def __init__(self, model: Any):
        self.model = model
        hp = model.hparams
        self.hp = hp
        b = model.backend
        self.b = b
        self.fg = FusedGpu(b)
        xp = self.xp = b.xp
        f32 = xp.float32
        d = hp.n_embd
        self.d = d
        self.attn_layers = hp.attention_layers
        self.dn_layers = hp.deltanet_layers
        self._dn_index = {il: z for z, il in enumerate(self.dn_layers)}
        self.H, self.Hkv, self.D = hp.n_head, hp.n_head_kv, hp.head_dim
        self.nk, self.nv, self.dk, self.dv = hp.ssm_n_k_heads, hp.ssm_n_v_heads, hp.d_k, hp.d_v
        self.C = hp.conv_channels
        self.R = self.C + 2 * self.nv
        self.Kc = hp.conv_kernel
        self.V = model.n_vocab

        self.act_d = ActBuffer(xp, d)
        self.act_ff = ActBuffer(xp, hp.n_ff)
        self.act_attn = ActBuffer(xp, self.H * self.D) if self.attn_layers else None
        self.act_dn = ActBuffer(xp, hp.ssm_inner) if self.dn_layers else None
        # The residual stream: two float32 buffers and two int64 fixed-point accumulators. A residual
        # add (mm MODE_ADD) adds into an accumulator; the next RMSNorm prep folds it in, writing
        # x + acc to the other x buffer (its other blocks still read the whole rows) and clearing the
        # other accumulator for the next add (see _Residual).
        self.xs = (xp.zeros((MAX_T, d), dtype=f32), xp.zeros((MAX_T, d), dtype=f32))
        self.accs = (xp.zeros((MAX_T, d), dtype=xp.int64), xp.zeros((MAX_T, d), dtype=xp.int64))
        if self.dn_layers:
            # the DeltaNet projections, as the int64 fixed-point sums their matmul adds (no exchange
            # between blocks), cleared for the next layer's matmul: z by gdn_out_prep as it reads it,
            # qkv and ab by DeltaNet layer parity: gdn_conv clears the other parity's (its own rows are
            # read by two of its token blocks; the other's last reader has finished)
            self.qkv_sums = tuple(xp.zeros((MAX_T, self.C), dtype=xp.int64) for _ in range(2))
            self.z = xp.zeros((MAX_T, hp.ssm_inner), dtype=xp.int64)
            self.ab_sums = tuple(xp.zeros((MAX_T, 2 * self.nv), dtype=xp.int64) for _ in range(2))
            self.rec = xp.zeros((MAX_T, self.R), dtype=f32)
            self.o = xp.zeros((MAX_T, hp.ssm_inner), dtype=f32)
            # verify records, per DeltaNet layer
            self.rec_qkv = {il: xp.zeros((self.Kc - 1 + MAX_T, self.C), dtype=f32) for il in self.dn_layers}
            self.rec_in = {il: xp.zeros((MAX_T, self.R), dtype=f32) for il in self.dn_layers}
            self.bak = {il: xp.zeros((self.nv, self.dv, self.dk), dtype=f32) for il in self.dn_layers}
        if self.attn_layers:
            from kernels.fused_gpu import ATT_MAX_SPLITS
            self.att_tc = self.fg.att_tensor_cores(self.D)      # the family decode and verify both take
            self.qg = xp.zeros((MAX_T, 2 * self.H * self.D), dtype=f32)
            self.kb = xp.zeros((MAX_T, self.Hkv * self.D), dtype=f32)
            self.vb = xp.zeros((MAX_T, self.Hkv * self.D), dtype=f32)
            self.qrot = xp.zeros((MAX_T, self.H, self.D), dtype=f32)
            self.part_o = xp.zeros((MAX_T, self.H, ATT_MAX_SPLITS, self.D), dtype=f32)
            self.part_ml = xp.zeros((MAX_T, self.H, ATT_MAX_SPLITS, 2), dtype=f32)
        self.logits = xp.zeros((MAX_T, self.V), dtype=f32)
        self.ids_out = xp.zeros(MAX_T, dtype=xp.int32)
        # top-k of the last row, one buffer so that one copy brings it to the host:
        # [0] NaN / +inf count, [1 : 1+k] ids, [1+k : 1+2k] the values' float32 bits
        self.topk_out = xp.zeros(1 + 2 * TOPK_MAX, dtype=xp.int32)
        self._topk_ops: dict[int, Op] = {}
        self._topk_rows: Any = None          # [meta T | ids T*k | vals T*k] of a verify, allocated at first use
        # params block: [0] n_past, [1] n_keep (commit), [2:2+T] token ids
        self.params = xp.zeros(2 + MAX_T, dtype=xp.int32)
        self._params_host = np.zeros(2 + MAX_T, dtype=np.int32)

        # state table layout
        slots, off = {}, 0
        for il in self.attn_layers:
            slots[("kv", il)] = off
            off += 3
        for il in self.dn_layers:
            slots[("conv", il)] = off
            off += 1
            slots[("adv", il)] = off
            off += 4
            slots[("chain", 0, il)] = off        # GreedyChain: the state from buffer p to buffer 1 - p
            off += 4
            slots[("chain", 1, il)] = off
            off += 4
            slots[("ver", il)] = off
            off += 4
        slots["commit_recur"] = off
        off += 4 * len(self.dn_layers)
        slots["commit_conv"] = off
        off += 2 * len(self.dn_layers)
        self._slots = slots
        self.table = xp.zeros(max(1, off), dtype=xp.uint64)
        self._table_host = np.zeros(max(1, off), dtype=np.uint64)
        self._bound: weakref.ref | None = None
        # GreedyChain's buffers, allocated at its first use: the delta-rule states a chained step
        # writes (it reads one buffer and writes the other, so the step after the last token the
        # host wanted leaves the state it read intact) and the conv state before the last step
        self.ssm_alt: dict[int, Any] | None = None
        self.conv_bak: dict[int, Any] | None = None

        # split-K workspace: the largest need of any launch
        need_f, need_c = 0, 0
        for weights, mode in self._all_launch_weights():
            f, c = self.fg.workspace_need(weights, mode)
            need_f, need_c = max(need_f, f), max(need_c, c)
        self.ws = MmWorkspace(xp, need_f, need_c)

        self._plans: dict[tuple, tuple[list[Op], Any]] = {}
        self._captures: dict[tuple, list[Any]] = {}
        self.generation = 0
        self.graphs = bool(getattr(b, "supports_graphs", False))

    # -- launch groups --------------------------------------------------------------------------
    @staticmethod
    def _group(segs: Sequence[tuple]) -> list[list[tuple]]:
        """Segments of one projection as launches: one launch for up to two weight types (mm_tc runs
        each type on its share of the grid: one launch boundary fewer than a launch per type), a
        launch per type beyond that."""
        groups: dict[int, list[tuple]] = {}
        for s in segs:
            groups.setdefault(s[0].qtype, []).append(s)
        if len(groups) <= 2:
            return [list(segs)]
        return list(groups.values())

    @staticmethod
    def _type_names(g: Sequence[tuple]) -> str:
        return "+".join(dict.fromkeys(s[0].type_name for s in g))

    def _all_launch_weights(self):
        m = self.model
        for il, layer in enumerate(m.layers):
            mx = layer.mixer
            if hasattr(mx, "w_qkv"):
                for g in self._group([(mx.w_qkv,), (mx.w_gate,), (mx.w_alpha,), (mx.w_beta,)]):
                    yield [s[0] for s in g], MODE_ADD
                yield [mx.w_out], MODE_ADD
            else:
                for g in self._group([(mx.wq,), (mx.wk,), (mx.wv,)]):
                    yield [s[0] for s in g], MODE_STORE
                yield [mx.wo], MODE_ADD
            yield [layer.ffn_gate, layer.ffn_up], MODE_SWIGLU
            yield [layer.ffn_down], MODE_ADD
        yield [m.output], MODE_STORE

    # -- state binding --------------------------------------------------------------------------
    def _bind(self, state: Any) -> None:
        """Point the state table at `state`'s arrays. The step only ever writes them in place, so a
        state stays bound until another one is used (its arrays are read once per binding, not per
        step)."""
        if self._bound is not None and self._bound() is state:
            return
        ptr = self.fg.ptr
        t = self._table_host
        s = self._slots
        for il in self.attn_layers:
            o = s[("kv", il)]
            t[o], t[o + 1], t[o + 2] = ptr(state.k_cache[il]), ptr(state.v_cache[il]), state.max_ctx
        for z, il in enumerate(self.dn_layers):
            t[s[("conv", il)]] = ptr(state.conv[il])
            o = s[("adv", il)]
            t[o:o + 4] = (ptr(self.rec), ptr(state.ssm[il]), ptr(state.ssm[il]), 0)
            if self.ssm_alt is not None:
                own, alt = ptr(state.ssm[il]), ptr(self.ssm_alt[il])
                o = s[("chain", 0, il)]
                t[o:o + 4] = (ptr(self.rec), own, alt, 0)
                o = s[("chain", 1, il)]
                t[o:o + 4] = (ptr(self.rec), alt, own, 0)
            o = s[("ver", il)]
            t[o:o + 4] = (ptr(self.rec_in[il]), ptr(state.ssm[il]), 0, ptr(self.bak[il]))
            o = s["commit_recur"] + 4 * z
            t[o:o + 4] = (ptr(self.rec_in[il]), ptr(self.bak[il]), ptr(state.ssm[il]), 0)
            o = s["commit_conv"] + 2 * z
            t[o:o + 2] = (ptr(self.rec_qkv[il]), ptr(state.conv[il]))
        self._upload(self.table, t)
        self._bound = weakref.ref(state)

    def _upload(self, dst, host: np.ndarray) -> None:
        if self.xp is np:
            dst[...] = host
        else:
            dst.set(host)

    # -- plans ----------------------------------------------------------------------------------
    def _plan(self, T: int, mode: str, logits: str, capture: tuple[int, ...], splits: int) -> list[Op]:
        m, hp, fg, xp = self.model, self.hp, self.fg, self.xp
        eps, d = hp.rms_eps, self.d
        ops: list[Any] = []
        tbl = self.table
        ws = self.ws
        ops.append(fg.op_embed("embed", m.token_embd, self.params[2:], self.xs[0], T))
        sums = [a[:T] for a in self.accs]
        if self.dn_layers:
            sums += [a[:T] for a in self.qkv_sums + self.ab_sums] + [self.z[:T]]
        # this is the start; then each sum is cleared by its consumer (z) or, for qkv and ab, by the
        # next DeltaNet layer's gdn_conv
        ops.append(_ZeroOp("clear sums", sums))
        res = _Residual(self.xs, self.accs)
        verify = mode == "verify"
        chain = mode.startswith("chain")         # "chain0" / "chain1": GreedyChain's steps

        def prep(label: str, w, row0: int = 0, n_rows: int = T) -> Op:
            return fg.op_prep_rows(label, res.x, d, row0, w, eps, d, True, self.act_d, n_rows, **res.fold())

        for il, layer in enumerate(m.layers):
            mx = layer.mixer
            p = f"blk.{il}."
            ops.append(prep(p + "attn_norm", layer.attn_norm))
            if hasattr(mx, "w_qkv"):
                par = self._dn_index[il] % 2
                qkv, ab = self.qkv_sums[par], self.ab_sums[par]
                segs = [(mx.w_qkv, qkv, 0, self.C), (mx.w_gate, self.z, 0, hp.ssm_inner),
                        (mx.w_alpha, ab, 0, 2 * self.nv), (mx.w_beta, ab, self.nv, 2 * self.nv)]
                for g in self._group(segs):
                    ops.append(fg.op_mm(p + "mm qkv|z|a|b " + self._type_names(g), g, self.act_d, T, MODE_ADD, ws))
                rec = self.rec_in[il] if verify else self.rec
                ops.append(fg.op_gdn_conv(p + "gdn_conv", qkv, self.C, tbl, self._slots[("conv", il)], mx.conv,
                                          ab, mx.dt_bias, mx.ssm_a, rec, T, self.nk, self.nv, self.dk, self.dv,
                                          self.Kc, eps, write_state=not verify,
                                          state_save=(self.rec_qkv[il] if verify else
                                                      self.conv_bak[il] if chain else None),
                                          qkv_save=self.rec_qkv[il][self.Kc - 1:] if verify else None,
                                          clear=(self.qkv_sums[1 - par][:T], self.ab_sums[1 - par][:T]),
                                          tokens_per_block=GDN_CONV_TOKENS if verify else T))
                slot = self._slots[("ver", il) if verify else ("chain", int(mode[-1]), il) if chain else ("adv", il)]
                ops.append(fg.op_gdn_recur(p + "gdn_recur", tbl[slot:], 1, T, None, self.o, self.nk, self.nv, self.dk,
                                           self.dv))
                ops.append(fg.op_gdn_out_prep(p + "gdn_out_prep", self.o, self.z, hp.ssm_inner, mx.ssm_norm, eps,
                                              self.nv, self.dv, self.act_dn, T))
                ops.append(fg.op_mm(p + "mm ssm_out " + mx.w_out.type_name, [(mx.w_out, res.add(), 0, d)],
                                    self.act_dn, T, MODE_ADD, ws))
            else:
                H, Hkv, D = self.H, self.Hkv, self.D
                segs = [(mx.wq, self.qg, 0, 2 * H * D), (mx.wk, self.kb, 0, Hkv * D), (mx.wv, self.vb, 0, Hkv * D)]
                for g in self._group(segs):
                    ops.append(fg.op_mm(p + "mm q|k|v " + self._type_names(g), g, self.act_d, T, MODE_STORE, ws))
                slot = self._slots[("kv", il)]
                ops.append(fg.op_attn_qk_rope_kv(p + "attn_qk_rope_kv", self.qg, self.kb, self.vb, mx.q_norm,
                                                 mx.k_norm, eps, self.params, tbl, slot, self.qrot, H, Hkv, D,
                                                 hp.n_rot, hp.rope_theta, T))
                ops.append(fg.op_attn_partial(p + "attn_partial", self.qrot, self.params, tbl, slot, self.part_o,
                                              self.part_ml, H, Hkv, D, 1.0 / math.sqrt(D), T,
                                              tensor_cores=self.att_tc, splits=splits))
                ops.append(fg.op_attn_combine_prep(p + "attn_combine_prep", self.part_o, self.part_ml, self.qg, H, D,
                                                   self.act_attn, T, splits))
                ops.append(fg.op_mm(p + "mm attn_output " + mx.wo.type_name, [(mx.wo, res.add(), 0, d)],
                                    self.act_attn, T, MODE_ADD, ws))
            ops.append(prep(p + "post_norm", layer.post_norm))
            ops.append(fg.op_mm(p + "mm ffn_gate|up " + layer.ffn_gate.type_name,
                                [(layer.ffn_gate, None, 0, 0), (layer.ffn_up, None, 0, 0)], self.act_d, T, MODE_SWIGLU,
                                ws, out_act=self.act_ff, variant=WIDE_SWIGLU_VARIANT if 8 < T <= 24 else ()))
            ops.append(fg.op_mm(p + "mm ffn_down " + layer.ffn_down.type_name, [(layer.ffn_down, res.add(), 0, d)],
                                self.act_ff, T, MODE_ADD, ws))
            if il in capture:
                # the layer's output is x + the pending sum: folded by a prep of no norm into the
                # activation buffer that the next prep overwrites anyway
                ops.append(fg.op_prep_rows(p + "fold", res.x, d, 0, None, 0.0, d, False, self.act_d, T, **res.fold()))
                buf = self._capture_buffer(capture, il)
                ops.append(_CopyOp(p + "capture", xp, buf[:T], res.x[:T]))
        if logits != "none":
            n_rows = 1 if logits == "last" else T
            row0 = T - 1 if logits == "last" else 0
            ops.append(prep("output_norm", m.output_norm, row0, n_rows))
            ops.append(fg.op_mm("mm output " + m.output.type_name, [(m.output, self.logits, 0, self.V)], self.act_d,
                                n_rows, MODE_STORE, ws))
            ops.append(fg.op_argmax("argmax", self.logits, self.V, self.V, self.ids_out, n_rows))
        if chain:
            ops.append(fg.op_step_chain("step_chain", self.params, self.ids_out))
        return self._chained(ops) if CHAIN_STEP and T == 1 else ops

    def _chained(self, ops: list[Any]) -> list[Any]:
        """CHAIN_STEP: every run of two or more adjacent launches that a chain can take (products; with
        2 also one-row norm preps; with 3 also DeltaNet's conv, recurrence and gated norm), holding a
        product, as one op_mm_chain launch."""
        def takes(op) -> bool:
            phase = getattr(op, "chain_phase", {})
            return (bool(getattr(op, "mm_kind", ())) or (CHAIN_STEP >= 2 and phase.get("kind") == MM_CHAIN_PREP)
                    or (CHAIN_STEP >= 3 and bool(phase)))
        out: list[Any] = []
        run: list[Any] = []
        for op in ops + [None]:
            if op is not None and takes(op):
                run.append(op)
                continue
            if len(run) >= 2 and any(o.mm_kind for o in run):
                # "blk.<first op's layer>.chain of n: <first> .. <last>" (the launch's kind without its layers,
                # as the bench's profile groups launches)
                first, last = (o.label.split(".", 2)[2] if o.label.startswith("blk.") else o.label
                               for o in (run[0], run[-1]))
                label = f"{run[0].label[:len(run[0].label) - len(first)]}chain of {len(run)}: {first} .. {last}"
                out.append(self.fg.op_mm_chain(label, run))
            else:
                out += run
            run = []
            if op is not None:
                out.append(op)
        return out

    def _capture_buffer(self, capture: tuple[int, ...], il: int):
        bufs = self._captures.get(capture)
        if bufs is None:
            bufs = self._captures[capture] = {i: self.xp.zeros((MAX_T, self.d), dtype=self.xp.float32) for i in capture}
        return bufs[il]

    def _commit_ops(self) -> list[Op]:
        fg, n = self.fg, len(self.dn_layers)
        if n == 0:
            return []
        return [fg.op_gdn_commit_conv("commit conv", self.table[self._slots["commit_conv"]:], n, self.params, self.C,
                                      self.Kc),
                fg.op_gdn_recur("commit recur", self.table[self._slots["commit_recur"]:], n, 0, self.params[1:], None,
                                self.nk, self.nv, self.dk, self.dv)]

    def _runner(self, key: tuple, build) -> Any:
        """The callable for a plan: a captured CUDA graph (GPU), or the launch list run in order."""
        entry = self._plans.get(key)
        if entry is None:
            ops = build()
            graph = self.b.capture_graph(ops) if self.graphs else None
            entry = self._plans[key] = (ops, graph)
        return entry

    def plan_key(self, T: int, mode: str, logits: str, n_keys: int, capture: Collection[int] = ()) -> tuple:
        """The plan (captured graph) of a T-token step whose longest row attends to n_keys keys:
        attention launches as many key splits as that row takes (att_launch_splits), so a growing
        context moves to another graph at each doubling of the splits."""
        cap = tuple(sorted(int(i) for i in capture))
        splits = att_launch_splits(n_keys, self.att_tc) if self.attn_layers else 0
        return (T, mode, logits, cap, splits)

    def _build(self, key: tuple):
        T, mode, logits, cap, splits = key
        return lambda: self._plan(T, mode, logits, cap, splits)

    def ops_for(self, T: int, mode: str = "advance", logits: str = "last", capture: Collection[int] = (),
                n_keys: int = 1) -> list[Op]:
        """The launch list of a step (benchmarks time each launch of it)."""
        key = self.plan_key(T, mode, logits, n_keys, capture)
        return self._runner(key, self._build(key))[0]

    def _launch(self, key: tuple, build) -> None:
        ops, graph = self._runner(key, build)
        if graph is not None:
            self.b.launch_graph(graph)
        else:
            for op in ops:
                op()

    # -- running --------------------------------------------------------------------------------
    def step(self, ids: Sequence[int], state: Any, mode: str = "advance", logits: str = "last",
             capture: Collection[int] = (), top_k: int = 0) -> tuple[Any, dict[int, np.ndarray]]:
        """One step of T = len(ids) <= 32 tokens at positions state.n_past... Returns (out, captured):
        out = host logits [1 | T, V] ("last" / "all"), int64 ids [1 | T] ("argmax_last" / "argmax"),
        the top_k largest logits of the last row as (int64 ids ascending, float32 values)
        ("topk_last"; the whole row [1, V] instead when it holds a NaN or +inf, for the sampler to
        reject), a list of that per row ("topk": sampled speculative verify), or None ("none");
        captured = {il: float32 [T, n_embd]}."""
        T = len(ids)
        if not 1 <= T <= MAX_T:
            raise ValueError(f"a GPU step takes 1..{MAX_T} tokens, got {T}")
        if logits in ("topk_last", "topk") and not 1 <= top_k <= min(TOPK_MAX, self.V):
            raise ValueError(f"top_k={top_k}: a GPU step hands 1..{min(TOPK_MAX, self.V)} candidates to the host")
        cap = tuple(sorted(int(i) for i in capture))
        plan_logits = {"last": "last", "all": "all", "none": "none", "argmax": "all", "argmax_last": "last",
                       "topk_last": "last", "topk": "all"}[logits]
        self._bind(state)
        ph = self._params_host
        ph[0] = state.n_past
        ph[1] = 0
        ph[2:2 + T] = np.asarray(ids, dtype=np.int64)
        self._upload(self.params, ph)
        key = self.plan_key(T, mode, plan_logits, state.n_past + T, cap)
        self._launch(key, self._build(key))
        state.n_past += T
        out = None
        n_rows = 1 if plan_logits == "last" else T
        if logits in ("argmax", "argmax_last"):
            out = self._to_host(self.ids_out[:n_rows]).astype(np.int64)
        elif logits == "topk_last":
            out = self._topk_last(top_k)
        elif logits == "topk":
            out = self._topk_all(top_k, T)
        elif logits != "none":
            out = np.array(self._to_host(self.logits[:n_rows]), dtype=np.float32, copy=True)
        captured = {}
        if cap:
            bufs = self._captures[cap]
            captured = {il: np.array(self._to_host(bufs[il][:T]), dtype=np.float32, copy=True) for il in cap}
        return out, captured

    def _topk_last(self, k: int):
        """The k largest logits of row 0 of the last step's logits (a "last" plan leaves the last
        token's row there), selected on the device: one small copy instead of the vocabulary."""
        op = self._topk_ops.get(k)
        if op is None:
            buf = self.topk_out
            op = self._topk_ops[k] = self.fg.op_topk("topk", self.logits, self.V, self.V, k, buf[1:1 + k],
                                                     buf[1 + k:1 + 2 * k], buf[0:1], 1)
        op()
        host = self._to_host(self.topk_out[:1 + 2 * k])
        if host[0] > 0:
            return np.array(self._to_host(self.logits[:1]), dtype=np.float32, copy=True)
        return host[1:1 + k].astype(np.int64), host[1 + k:1 + 2 * k].view(np.float32).copy()

    def _topk_all(self, k: int, T: int) -> list:
        """`_topk_last` for each of the T rows of an "all" step (a sampled verify): per row (ids,
        vals), or the row [V] itself when it holds a NaN or +inf. One launch, one copy of T*(2k+1)
        words instead of T rows of the vocabulary."""
        if self._topk_rows is None:
            self._topk_rows = self.xp.zeros(MAX_T * (1 + 2 * TOPK_MAX), dtype=self.xp.int32)
        buf = self._topk_rows
        # built per call (T and k vary from verify to verify; building a launch is cheap)
        self.fg.op_topk("topk rows", self.logits, self.V, self.V, k, buf[T:T + T * k], buf[T + T * k:T + 2 * T * k],
                        buf[:T], T)()
        host = self._to_host(buf[:T + 2 * T * k])
        meta, ids = host[:T], host[T:T + T * k].reshape(T, k)
        vals = host[T + T * k:T + 2 * T * k].view(np.float32).reshape(T, k)
        out = []
        for t in range(T):
            if meta[t] > 0:
                out.append(np.array(self._to_host(self.logits[t]), dtype=np.float32, copy=True))
            else:
                out.append((ids[t].astype(np.int64), vals[t].copy()))
        return out

    def _to_host(self, a) -> np.ndarray:
        return a if self.xp is np else self.xp.asnumpy(a)

    def verify(self, ids: Sequence[int], state: Any, logits: str = "all", capture: Collection[int] = (),
               top_k: int = 0):
        """A speculative block: logits (or ids, or per-row top-k candidates) of every row, captured
        layers, and the record `commit` needs. The recurrent state is left as it was; n_past
        advances by T."""
        n0 = state.n_past
        out, captured = self.step(ids, state, mode="verify", logits=logits, capture=capture, top_k=top_k)
        self.generation += 1
        rec = GpuVerifyRecord(n_past0=n0, n_tokens=len(ids), generation=self.generation, state_id=id(state))
        return out, captured, rec

    def commit(self, state: Any, record: GpuVerifyRecord, n_keep: int) -> None:
        """Keep the first n_keep tokens of the verified block: exact state after them."""
        if record.generation != self.generation or record.state_id != id(state):
            raise _StateError("this verify record is stale: another verify ran since, or it belongs to another state")
        if not 0 <= n_keep <= record.n_tokens:
            raise ValueError(f"rollback keeps {n_keep} tokens of a {record.n_tokens}-token block")
        self._bind(state)
        ph = self._params_host
        ph[0] = record.n_past0
        ph[1] = n_keep
        self._upload(self.params, ph)
        self._launch(("commit",), self._commit_ops)
        state.n_past = record.n_past0 + n_keep

    def synchronize(self) -> None:
        fn = getattr(self.b, "synchronize", None)
        if fn is not None:
            fn()

    def greedy_chain(self, state: Any) -> "GreedyChain":
        """Greedy decoding of `state` with the host one step behind the device (GreedyChain)."""
        if self.ssm_alt is None and self.dn_layers:
            xp = self.xp
            self.ssm_alt = {il: xp.zeros_like(state.ssm[il]) for il in self.dn_layers}
            self.conv_bak = {il: xp.zeros_like(state.conv[il]) for il in self.dn_layers}
            self._bound = None                   # the chain slots of the table point at them from now on
        return GreedyChain(self, state)


class GreedyChain:
    """Greedy decoding with the host one step behind the device.

    A plain greedy loop waits for each step's token before it launches the next step, so the device
    idles while the host reads the id and launches the next graph (0.1-0.3 ms a step on the 27B,
    against a ~6.6 ms step). Here each step's graph ends by writing the next step's params from its
    own argmax on the device (fused.cu step_chain), so `next` queues the step after the one whose
    token it returns before waiting for that token.

    The step queued ahead is undone when the caller stops (a stop token, a stop string, a cancel):
    `close` takes n_past back, restores the conv states its gdn_conv saved before writing them and
    keeps the delta-rule states it read: chained steps read the states from one buffer and write them
    to the other (the state's own arrays and the step's `ssm_alt`, in turn), so the state before the
    step queued ahead is still whole. Its KV rows stay in the cache past n_past, unread and later
    overwritten (as after a rollback). `close` leaves the states in the state's own arrays: the
    state is then exactly what the same steps taken one at a time leave.

    Use: `tok = chain.next(tok, ahead=...)` for each step, `ahead` false when the caller knows it
    will not feed the returned token back (its last token); `close()` when done (also on errors)."""

    def __init__(self, step: Qwen35GpuStep, state: Any):
        self.step, self.state = step, state
        self.cur = 0                 # the buffer that holds the delta-rule states: 0 state.ssm, 1 step.ssm_alt
        self.queued: list[int] = []  # buffers read by the queued steps whose tokens the host has not read
        self.expect: int | None = None   # the token the step queued ahead consumes
        self.closed = False
        xp = step.xp
        self._host = xp is np
        if self._host:
            self._ids = np.zeros(2, dtype=np.int32)
            self._events: list[Any] = [None, None]
        else:
            import cupyx
            self._ids = cupyx.empty_pinned((2,), dtype=np.int32)     # page-locked: the copies are asynchronous
            self._events = [xp.cuda.Event(disable_timing=True) for _ in range(2)]
        self._n_launched = 0

    def _launch(self, token: int | None) -> None:
        """Queue one step: on `token` (uploaded with the position), or on the token the step before
        chose (None: already in the params block, written by that step's step_chain)."""
        step, st = self.step, self.state
        if st.n_past + 1 > st.max_ctx:
            raise ValueError(f"the state holds {st.max_ctx} positions, all used")
        step._bind(st)
        if token is not None:
            ph = step._params_host
            ph[0] = st.n_past
            ph[1] = 0
            ph[2] = token
            step._upload(step.params, ph)
        key = step.plan_key(1, f"chain{self.cur}", "last", st.n_past + 1)
        step._launch(key, step._build(key))
        st.n_past += 1
        slot = self._n_launched % 2
        self._n_launched += 1
        # the token to the host, queued behind the step and before the next step overwrites ids_out
        if self._host:
            self._ids[slot] = step.ids_out[0]
        else:
            xp = step.xp
            stream = xp.cuda.get_current_stream()
            xp.cuda.runtime.memcpyAsync(self._ids.ctypes.data + 4 * slot, step.ids_out.data.ptr, 4,
                                        xp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            self._events[slot].record(stream)
        self.queued.append(self.cur)
        self.cur = 1 - self.cur

    def next(self, token: int, ahead: bool = True) -> int:
        """The greedy token after `token` (the token this chain returned last, or the first one),
        having queued the step on it first when `ahead` (and the state has room)."""
        if self.closed:
            raise RuntimeError("this greedy chain is closed")
        token = int(token)
        if not 0 <= token < self.step.V:
            raise ValueError(f"token id {token} outside the vocabulary of {self.step.V}")
        if self.queued:
            if token != self.expect:
                raise ValueError(f"the step queued ahead consumes token {self.expect}, not {token}")
        else:
            self._launch(token)
        if ahead and self.state.n_past + 1 <= self.state.max_ctx:
            self._launch(None)
        slot = (self._n_launched - len(self.queued)) % 2
        self.queued.pop(0)
        if not self._host:
            self._events[slot].synchronize()
        out = int(self._ids[slot])
        self.expect = out
        return out

    def close(self) -> None:
        """Undo the step queued ahead, if any, and leave the states in the state's own arrays."""
        if self.closed:
            return
        self.closed = True
        step, st = self.step, self.state
        step.synchronize()
        if len(self.queued) > 1:
            raise RuntimeError("a greedy chain closed with two steps queued: the conv state before the first is lost")
        if self.queued:                          # the one step queued ahead
            self.cur = self.queued[0]
            st.n_past -= len(self.queued)
            self.queued.clear()
            for il in step.dn_layers:
                st.conv[il][...] = step.conv_bak[il]
        if self.cur == 1:
            for il in step.dn_layers:
                st.ssm[il][...] = step.ssm_alt[il]
            self.cur = 0
        step.synchronize()

    def __enter__(self) -> "GreedyChain":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Residual:
    """Which buffers hold the residual stream while a plan is built: x = xs[cur], plus the pending
    fixed-point sum accs[pend] when a residual add happened since the last fold. Adds alternate
    between the two accumulators; a fold reads x + accs[pend], writes xs[1 - cur] and clears the
    accumulator the next add uses (its last reader, the previous fold, has finished)."""

    def __init__(self, xs, accs):
        self.xs, self.accs = xs, accs
        self.cur, self.pend, self.next_acc = 0, None, 0

    @property
    def x(self):
        return self.xs[self.cur]

    def add(self):
        """The accumulator a residual add (mm MODE_ADD) adds into."""
        if self.pend is not None:
            raise RuntimeError("two residual adds without a fold between them")
        self.pend, self.next_acc = self.next_acc, 1 - self.next_acc
        return self.accs[self.pend]

    def fold(self) -> dict:
        """prep_rows' keyword arguments for the next read of x (and the buffers it moves to)."""
        if self.pend is None:
            return {}
        out = dict(acc=self.accs[self.pend], x_out=self.xs[1 - self.cur], acc_zero=self.accs[self.next_acc])
        self.cur, self.pend = 1 - self.cur, None
        return out


class _ZeroOp:
    """Arrays set to zero on the device (every fixed-point sum of the step, at its start)."""

    def __init__(self, label: str, arrays):
        self.label, self.arrays = label, list(arrays)
        self.weight_bytes = 0

    def __call__(self) -> None:
        for a in self.arrays:
            a.fill(0)


class _CopyOp:
    """dst[...] = src on the device (captured layers)."""

    def __init__(self, label: str, xp, dst, src):
        self.label, self.xp, self.dst, self.src = label, xp, dst, src
        self.weight_bytes = 0

    def __call__(self) -> None:
        self.xp.copyto(self.dst, self.src)

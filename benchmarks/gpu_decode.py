"""Decode throughput of a Llama-3-8B-shaped model with random weights on one CUDA GPU.

Writes a ``config.json`` (Llama-3-8B's shapes: 32 layers, hidden 4096, 32 query / 8 KV
heads of 128, vocab 128256), loads it with ``load_format="dummy"`` in bfloat16 and, for
each batch size, prefills ``batch`` random prompts, then times ``--decode-steps`` pure
decode steps (``ignore_eos``) replayed from CUDA graphs and as many run eagerly (the same
engine with its graphs set aside, which is what ``--enforce-eager`` runs), in the order
graphs, eager, eager, graphs so that the growing context weighs on both alike.
Throughput does not depend on the weight values.

Before the engine starts, the Triton decode attention (one layer, the same shapes and
context lengths) is timed alone, side by side with the torch backend's batched SDPA
decode, to give the achieved HBM bandwidth of the attention:
``bytes = 2 (K,V) x sum(context) x kv_heads x head_dim x 2 bytes`` per layer call.

Run by ``benchmarks/gpu_check.sh``; prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import tempfile
import time

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def _cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Mean seconds of ``fn()`` over ``iters`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def attention_bandwidth(batch: int, context: int, block_size: int = 16) -> dict:
    """Time one layer's decode attention (Triton and torch) at ``batch`` x ``context``."""
    from pagedserve.attention.backend import AttentionMetadata
    from pagedserve.attention.torch_attn import TorchAttention
    from pagedserve.attention.triton_attn import TritonAttention, decode_attention_bytes

    cfg = LLAMA3_8B
    kv_heads, heads, head_dim = cfg["num_key_value_heads"], cfg["num_attention_heads"], 128
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device="cuda",
                        dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq)
    seq_lens = [context] * batch
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(batch + 1, device="cuda"),
        seq_lens=torch.tensor(seq_lens, device="cuda"), block_tables=tables,
        query_lens_list=[1] * batch, seq_lens_list=seq_lens, num_decodes=batch,
        block_size=block_size,
    )
    query = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    nbytes = decode_attention_bytes(seq_lens, kv_heads, head_dim, 2)
    row = {"batch": batch, "context": context, "kv_bytes": nbytes}
    for name, backend in (("triton", TritonAttention()), ("torch", TorchAttention())):
        try:
            seconds = _cuda_time(lambda b=backend: b.forward(query, cache, meta, head_dim**-0.5))
        except torch.OutOfMemoryError:
            row[name] = None
            continue
        row[name] = {"us": seconds * 1e6, "GBps": nbytes / seconds / 1e9}
    return row


def _time_steps(engine, steps: int) -> float:
    """Seconds of ``steps`` engine steps."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_throughput(llm, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """Prefill ``batch`` random prompts, then time ``steps`` decode steps with CUDA graphs
    and ``steps`` without (``graphs`` None where the engine has none for this batch)."""
    from pagedserve import SamplingParams

    engine = llm.engine
    runner = engine.executor.driver_worker.model_runner
    captured = runner.decode_graphs
    graphs = captured if captured is not None and batch <= captured.max_batch_size else None
    # None = up to max_model_len (prompt + 2 x steps + 128): nobody finishes while timed,
    # even the requests that began decoding while later prompts were still prefilling.
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [random.randrange(vocab) for _ in range(prompt_len)]
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    t0 = time.perf_counter()
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < batch:  # until every request has its first token
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
        prefill_steps += 1
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    # graphs, eager, eager, graphs: the growing context weighs on both modes alike
    modes = ["graphs", "eager", "eager", "graphs"] if graphs is not None else ["eager", "eager"]
    seconds = dict.fromkeys(modes, 0.0)
    for i, mode in enumerate(modes):
        runner.decode_graphs = graphs if mode == "graphs" else None
        if mode not in modes[:i]:
            _time_steps(engine, 2)  # warm-up (kernel variants for this batch)
        seconds[mode] += _time_steps(engine, steps // 2)
    runner.decode_graphs = captured
    engine.abort_request(ids)
    timed = steps // 2 * 2
    row = {"batch": batch, "prefill_steps": prefill_steps,
           "prefill_phase_tokens_per_s": batch * prompt_len / prefill_s}
    for mode in ("graphs", "eager"):
        row[mode] = ({"decode_step_ms": seconds[mode] / timed * 1e3,
                      "decode_tokens_per_s": batch * timed / seconds[mode]}
                     if mode in seconds else None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    random.seed(0)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")

    # 1. decode attention alone (before the engine takes most of the memory)
    mid_context = args.prompt_len + args.decode_steps  # the middle of the timed decode steps
    attn = [attention_bandwidth(b, mid_context) for b in batches]
    attn += [attention_bandwidth(b, 4096) for b in (1, 16, 64)]
    torch.cuda.empty_cache()
    print("\ndecode attention, one layer, bf16, block 16 (Llama-3-8B heads 32/8 x 128)")
    print(f"{'batch':>6} {'context':>8} {'KV MiB':>8} {'triton us':>10} {'triton GB/s':>12} "
          f"{'torch us':>10} {'torch GB/s':>11}")
    for r in attn:
        t, p = r["triton"], r["torch"]
        print(f"{r['batch']:>6} {r['context']:>8} {r['kv_bytes'] / 2**20:>8.1f} "
              f"{t['us'] if t else float('nan'):>10.1f} {t['GBps'] if t else float('nan'):>12.0f} "
              f"{p['us'] if p else float('nan'):>10.1f} {p['GBps'] if p else float('nan'):>11.0f}")

    # 2. the engine, end to end, with CUDA graphs and eagerly
    from pagedserve import LLM

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # capture time

    with tempfile.TemporaryDirectory() as tmp:
        (pathlib.Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        t0 = time.perf_counter()
        llm = LLM(tmp, load_format="dummy", dtype="bfloat16", device="cuda",
                  skip_tokenizer_init=True, max_model_len=args.prompt_len + 2 * args.decode_steps + 128,
                  max_num_seqs=max(batches), max_num_batched_tokens=8192,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=False)
        load_s = time.perf_counter() - t0
    prof = llm.engine.executor.driver_worker.memory_profile
    backend = llm.engine.executor.driver_worker.attention_backend.name
    graphs = llm.engine.executor.driver_worker.model_runner.decode_graphs
    weights = prof.weights
    print(f"\nengine up in {load_s:.1f} s: weights {weights / 2**30:.1f} GiB, activation peak "
          f"{prof.peak_activation / 2**30:.2f} GiB, KV pool {llm.engine.num_blocks} blocks "
          f"({llm.engine.num_blocks * prof.bytes_per_block / 2**30:.1f} GiB), "
          f"attention backend {backend}, CUDA graphs for decode batches "
          f"{graphs.sizes if graphs else 'none'}")
    print(f"\ndecode, prompt {args.prompt_len}, {args.decode_steps} timed steps per mode, bf16 "
          "(floor: weights + KV read once at 4.3 TB/s)")
    print(f"{'batch':>6} {'graphs tok/s':>13} {'eager tok/s':>12} {'ratio':>6} {'graphs ms':>10} "
          f"{'eager ms':>9} {'floor ms':>9} {'prefill tok/s':>14}")
    nan = {"decode_tokens_per_s": float("nan"), "decode_step_ms": float("nan")}
    rows = []
    for b in batches:
        r = decode_throughput(llm, b, args.prompt_len, args.decode_steps, LLAMA3_8B["vocab_size"])
        kv_per_step = 32 * 2 * b * mid_context * 8 * 128 * 2
        # memory floor of one step: every weight and every cached K/V read once
        r["roofline_step_ms_at_4.3TBps"] = (weights + kv_per_step) / 4.3e12 * 1e3
        rows.append(r)
        g, e = r["graphs"] or nan, r["eager"]
        print(f"{b:>6} {g['decode_tokens_per_s']:>13.0f} {e['decode_tokens_per_s']:>12.0f} "
              f"{g['decode_tokens_per_s'] / e['decode_tokens_per_s']:>6.2f} "
              f"{g['decode_step_ms']:>10.2f} {e['decode_step_ms']:>9.2f} "
              f"{r['roofline_step_ms_at_4.3TBps']:>9.2f} {r['prefill_phase_tokens_per_s']:>14.0f}",
              flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"device": props.name, "torch": torch.__version__, "attention": attn,
             "decode": rows, "weights_bytes": weights,
             "graph_sizes": graphs.sizes if graphs else []}, indent=1))


if __name__ == "__main__":
    main()

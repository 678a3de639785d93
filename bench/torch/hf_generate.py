"""hf_generate.py: transformers generation with random weights, one cache per
process: tidalloc.hf.GrowableCache, DynamicCache (torch.cat every token) or
StaticCache (max_cache_len reserved up front, 2x the tokens produced by
default). Greedy decoding of exactly --new-tokens tokens from a random
prompt; appends a CSV row: the time per token over the whole generate call
(from a synchronized device to a synchronized device, after an untimed
warm-up generate of 16 tokens with the same kind of cache), the time per
token of the first and last 10% of the steps (host clock at each step's
logits: generate synchronizes every step to check its stopping criteria),
peak memory, and a digest of the generated ids, to compare with
DynamicCache's (--summarize).

The floor: what DynamicCache's torch.cat costs a token, at most, is a copy
of the whole cache (read and written) at its mean length over the run, at
the device's copy bandwidth (measured in the same process, a 1 GiB copy):
cat_ms_per_token. A cache that grows in place saves at most that, so the
best time per token it can reach is DynamicCache's minus it (--summarize's
"floor" column, a multiple of DynamicCache's time per token).

Whether the copies cost the step at all: every PROBE_EVERY-th step the
logits processor waits for the device right after the forward pass has been
issued, and notes how long the device was still busy (gpu_tail_ms_last10: the
mean over the probes of the last 10% of the steps). Where the host issues
the step slower than the device runs it, the tail is about zero and the
device's copies hide behind the host's work: less work on the device then
shortens the step by the tail at most. So over the last 10% of the steps a
cache without torch.cat saves at most min(cat_ms_last10, gpu_tail_ms_last10)
a token, cat_ms_last10 being the copy at the length of those steps
(--summarize's "floor, last 10%" column). generate waits for the device at
every step to check its stopping criteria anyway, so a probe moves that wait
earlier and adds none.

Where the host's time goes: --profile-steps N profiles N steps from a tenth
and from nine tenths of the run (operators by their own CPU time), and every
row counts the calls PyTorch's allocator made to the device
(torch_device_allocs) and its retries after a failed one.

Memory: PyTorch's peak allocated and reserved bytes, tidalloc's peak
reserved bytes (the growable caches' mapped pages; tidalloc is not PyTorch's
allocator here), and their sum: an upper bound of the peak of the sum, as
the cache's pages only grow during a run.

Models (random weights from the config, bf16 on a GPU, fp32 on the CPU,
attention through SDPA): gpt2 (124M: 12 layers, 12 heads of 64) and
llama1b (the Llama 3.2 1B shape: 16 layers, 32 query and 8 key/value heads
of 64, 1.24B parameters), and tiny versions of both for the CPU (--tiny).
StaticCache runs eager (generate's automatic compilation is turned off) so
that the three caches are timed on the same path; --static-compile leaves
it on. --sdpa holds the attention to one kernel: PyTorch may choose another
kernel for GrowableCache's strided views than for DynamicCache's contiguous
tensors, whose last bits differ, and greedy decoding over random weights'
nearly even logits turns that into other tokens; with --ids-out, --summarize
names the first token where the ids part.

    python bench/torch/hf_generate.py --model llama1b --batch 8 --new-tokens 2048 \\
        --cache growable --csv hf.csv
    python bench/torch/hf_generate.py --summarize hf.csv
    TIDALLOC_CONF=backend:host python bench/torch/hf_generate.py --tiny --device cpu \\
        --model gpt2 --new-tokens 32 --cache growable --csv hf.csv"""
import argparse
import csv
import hashlib
import os
import sys
import time
import warnings

import torch

# The package of this source tree, also when PYTHONPATH does not name it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
# sdpa.py and results_csv.py beside this file, also when this file is loaded by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_csv import append_rows  # noqa: E402
from sdpa import SDPA_KERNELS, sdpa_context  # noqa: E402

COLUMNS = ("model", "params_m", "batch", "prompt", "new_tokens", "cache", "max_cache_len",
           "device", "dtype", "transformers", "torch", "status", "seconds", "ms_per_token",
           "ms_per_token_first10", "ms_per_token_last10", "torch_peak_allocated_gib",
           "torch_peak_reserved_gib", "tidalloc_peak_reserved_gib", "peak_total_gib",
           "kv_bytes_gib", "ids_sha256", "error", "copy_gb_per_s", "cat_ms_per_token",
           "cat_ms_last10", "gpu_tail_ms_last10", "sdpa", "ids_file", "torch_device_allocs",
           "torch_alloc_retries", "profiled_steps")
CACHES = ("growable", "dynamic", "static")
# --sdpa (SDPA_KERNELS): the kernel scaled_dot_product_attention is held to,
# or PyTorch's own choice ("default"), which can differ between a contiguous
# cache and GrowableCache's strided views (tests/torch/kv_cache_gpu.py names
# both).
GiB = float(1 << 30)


def make_config(name, tiny, positions):
    import transformers
    if name == "gpt2":
        if tiny:
            return transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512,
                                           n_positions=positions)
        return transformers.GPT2Config(n_positions=positions)  # 12 layers, 12 heads, 768
    if name == "llama1b":
        if tiny:
            return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                            intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=512,
                                            max_position_embeddings=positions)
        return transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32,
                                        num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                        tie_word_embeddings=True, rope_theta=500000.0,
                                        max_position_embeddings=max(positions, 131072))
    raise ValueError("unknown model %r" % name)


def build_model(args, positions):
    import transformers
    config = make_config(args.model, args.tiny, positions)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None          # exactly --new-tokens tokens
    gc.pad_token_id = 0
    if not args.static_compile:
        gc.disable_compile = True
    return model, dtype


def make_cache(kind, model, max_cache_len):
    if kind == "growable":
        from tidalloc.hf import GrowableCache
        return GrowableCache(config=model.config, max_cache_len=max_cache_len)
    if kind == "dynamic":
        from transformers import DynamicCache
        return DynamicCache()
    from transformers import StaticCache
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


# Steps between two probes of the device's tail (module docstring).
PROBE_EVERY = 16


class StepClock:
    """A logits processor that notes the host clock at every step and, every
    PROBE_EVERY-th step on a GPU, how long the device still worked after
    the forward pass was issued (tails: (step, seconds))."""

    def __init__(self, device="cpu"):
        self.marks = []
        self.tails = []
        self.probe = device.startswith("cuda")

    def __call__(self, input_ids, scores):
        now = time.perf_counter()
        self.marks.append(now)
        if self.probe and len(self.marks) % PROBE_EVERY == 0:
            torch.cuda.synchronize()
            self.tails.append((len(self.marks) - 1, time.perf_counter() - now))
        return scores

    def tail_ms_last10(self):
        """Mean tail in ms over the probes of the last 10% of the steps."""
        start = len(self.marks) - max(1, len(self.marks) // 10)
        last = [t for step, t in self.tails if step >= start]
        return "%.4f" % (1e3 * sum(last) / len(last)) if last else ""


class StepProfiler:
    """A logits processor that profiles a run's work (torch.profiler) over
    `steps` steps from a tenth of the run and again from nine tenths, and
    keeps each window's table of operators by their own host time, and on a
    GPU a second by their own device time: where a step's time goes early
    and late, when it grows with the cache, and on which side. The profiled
    steps run slower, so a profiled run's times are not comparable to others
    (the row's profiled_steps says so)."""

    def __init__(self, new_tokens, steps, device="cpu"):
        self.windows = [(new_tokens // 10, "early"), (new_tokens * 9 // 10, "late")]
        self.steps = steps
        self.step = 0
        self.active = None
        self.tables = []
        self.gpu = device.startswith("cuda")

    def __call__(self, input_ids, scores):
        from torch.profiler import ProfilerActivity, profile
        if self.active is not None and self.step >= self.active[1] + self.steps:
            prof, start, name = self.active
            prof.stop()
            averages = prof.key_averages()
            self.tables.append("%s: steps %d-%d, by host time\n%s" % (
                name, start, start + self.steps - 1,
                averages.table(sort_by="self_cpu_time_total", row_limit=15)))
            if self.gpu:
                try:
                    table = averages.table(sort_by="self_device_time_total", row_limit=15)
                except (AttributeError, KeyError, ValueError):  # the name before torch 2.4
                    table = averages.table(sort_by="self_cuda_time_total", row_limit=15)
                self.tables.append("%s: steps %d-%d, by device time\n%s" % (
                    name, start, start + self.steps - 1, table))
            self.active = None
        for start, name in self.windows:
            if self.step == start and self.active is None:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu
                                                       else [])
                prof = profile(activities=activities)
                prof.start()
                self.active = (prof, start, name)
        self.step += 1
        return scores

    def profiled_steps(self):
        return self.steps * len(self.windows_done())

    def windows_done(self):
        return [t for t in self.tables if ", by host time" in t.split("\n", 1)[0]]


def generate(model, ids, cache, new_tokens, clock=None, profiler=None):
    from transformers import LogitsProcessorList
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, past_key_values=cache)
    processors = [p for p in (clock, profiler) if p is not None]
    if processors:
        kwargs["logits_processor"] = LogitsProcessorList(processors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer transformers call past_key_values `cache`
        with torch.no_grad():
            return model.generate(**kwargs)


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def tidalloc_peak(device):
    """tidalloc's peak reserved bytes on the device, or 0 when unused."""
    if "tidalloc" not in sys.modules:
        return 0
    import tidalloc
    return tidalloc.stats(torch.device(device).index or 0).reserved_bytes[0].peak


def reset_peaks(device):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if "tidalloc" in sys.modules:
        import tidalloc
        tidalloc.reset_peak(torch.device(device).index or 0)


def kv_bytes(model, batch, tokens, dtype):
    c = model.config.get_text_config(decoder=True)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * batch * heads * head_dim * tokens * \
        torch.empty((), dtype=dtype).element_size()


def copy_bandwidth(device):
    """Bytes per second a device-to-device copy moves (read plus written),
    from the best of a few copies of 1 GiB (64 MiB on the CPU)."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * n / best


def per_token(marks, part):
    """ms per token over the first (part=0) or last (1) 10% of the steps."""
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    if not gaps:
        return ""
    n = max(1, len(gaps) // 10)
    chosen = gaps[:n] if part == 0 else gaps[-n:]
    return "%.4f" % (1e3 * sum(chosen) / len(chosen))


def run(args):
    import transformers
    positions = args.prompt + args.new_tokens
    max_cache_len = args.max_cache_len or max(2 * args.new_tokens, positions)
    model, dtype = build_model(args, max(positions, max_cache_len))
    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=g).to(args.device)
    row = dict(model=args.model + ("-tiny" if args.tiny else ""), batch=args.batch,
               params_m="%.1f" % (sum(p.numel() for p in model.parameters()) / 1e6),
               prompt=args.prompt, new_tokens=args.new_tokens, cache=args.cache,
               max_cache_len=max_cache_len if args.cache != "dynamic" else "",
               device=args.device, dtype=str(dtype).replace("torch.", ""),
               transformers=transformers.__version__, torch=torch.__version__, status="ok",
               kv_bytes_gib="%.3f" % (kv_bytes(model, args.batch, positions, dtype) / GiB),
               error="", sdpa=args.sdpa)
    bandwidth = copy_bandwidth(args.device)
    token_bytes = 2 * kv_bytes(model, args.batch, 1, dtype)  # a token's cache, read and written
    cat_bytes = token_bytes * (args.prompt + args.new_tokens / 2.0)  # at the mean length
    end_bytes = token_bytes * (args.prompt + args.new_tokens * 0.95)  # the last 10%'s mean
    row.update(copy_gb_per_s="%.1f" % (bandwidth / 1e9),
               cat_ms_per_token="%.4f" % (1e3 * cat_bytes / bandwidth),
               cat_ms_last10="%.4f" % (1e3 * end_bytes / bandwidth))
    # Untimed: kernels, cuBLAS handles, the cache kind's first use.
    warm = make_cache(args.cache, model, max_cache_len)
    with sdpa_context(args.sdpa):
        generate(model, ids, warm, min(16, args.new_tokens))
    if hasattr(warm, "close"):
        warm.close()
    del warm
    synchronize(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    cache = make_cache(args.cache, model, max_cache_len)
    reset_peaks(args.device)
    clock = StepClock(args.device)
    profiler = (StepProfiler(args.new_tokens, args.profile_steps, args.device)
                if args.profile_steps else None)
    try:
        synchronize(args.device)
        start = time.perf_counter()
        with sdpa_context(args.sdpa):
            out = generate(model, ids, cache, args.new_tokens, clock, profiler)
        synchronize(args.device)
        seconds = time.perf_counter() - start
        produced = out.shape[1] - args.prompt
        if produced != args.new_tokens:
            raise RuntimeError("generated %d tokens, not %d" % (produced, args.new_tokens))
        row.update(seconds="%.3f" % seconds, ms_per_token="%.4f" % (1e3 * seconds / produced),
                   ms_per_token_first10=per_token(clock.marks, 0),
                   ms_per_token_last10=per_token(clock.marks, 1),
                   gpu_tail_ms_last10=clock.tail_ms_last10(),
                   ids_sha256=hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()[:16])
        if profiler is not None:
            row["profiled_steps"] = profiler.profiled_steps()
            print("\n\n".join(profiler.tables), file=sys.stderr, flush=True)
        if args.ids_out:
            torch.save(out.cpu(), args.ids_out)
            # Named relative to the CSV where they share a folder, so that the
            # summary finds it wherever the folder is copied.
            row["ids_file"] = (os.path.basename(args.ids_out) if args.csv and
                               os.path.dirname(os.path.abspath(args.ids_out)) ==
                               os.path.dirname(os.path.abspath(args.csv)) else args.ids_out)
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=" ".join(str(e).split())[:200])
    if args.device.startswith("cuda"):
        tp_alloc = torch.cuda.max_memory_allocated()
        tp_res = torch.cuda.max_memory_reserved()
        stats = torch.cuda.memory_stats()
        # Calls PyTorch's allocator made to the device (cudaMalloc, or a
        # segment's growth under expandable segments) and retries after a
        # failed one: where DynamicCache's new, longer tensors cost the host.
        row.update(torch_device_allocs=stats.get("num_device_alloc", ""),
                   torch_alloc_retries=stats.get("num_alloc_retries", ""))
        td = tidalloc_peak(args.device)
        row.update(torch_peak_allocated_gib="%.3f" % (tp_alloc / GiB),
                   torch_peak_reserved_gib="%.3f" % (tp_res / GiB),
                   tidalloc_peak_reserved_gib="%.3f" % (td / GiB),
                   peak_total_gib="%.3f" % ((tp_res + td) / GiB))
    if hasattr(cache, "close"):
        cache.close()
    return row


def summarize(path, out=sys.stdout):
    """Per (model, batch, new tokens): each cache's time per token and peak
    against DynamicCache's, and whether its ids equal DynamicCache's.
    Returns the number of groups whose greedy outputs differ from it."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    groups = {}
    for r in rows:
        key = (r["model"], r["batch"], r["new_tokens"], r.get("sdpa") or "default")
        groups.setdefault(key, {})[r["cache"]] = r
    folder = os.path.dirname(os.path.abspath(path))
    differ = 0
    print("%-18s %5s %6s  %-9s %10s %8s %8s %10s %7s  %-15s %s" % (
        "model", "batch", "tokens", "cache", "ms/token", "x dyn", "last10%", "peak GiB",
        "x dyn", "ids=dynamic's", "floor (x dyn) [floor, last 10%]"), file=out)
    for (model, batch, tokens, kernel), by in sorted(groups.items()):
        if kernel != "default":
            model = "%s/%s" % (model, kernel)
        ref = by.get("dynamic")
        for kind in CACHES:
            r = by.get(kind)
            if r is None:
                continue
            if r["status"] != "ok":
                print("%-18s %5s %6s  %-9s %s" % (model, batch, tokens, kind, r["status"]),
                      file=out)
                continue
            ratio = peak_ratio = same = floor = ""
            if kind == "dynamic" and r.get("cat_ms_per_token"):
                # The best time per token a cache without torch.cat can reach.
                dyn = float(r["ms_per_token"])
                floor = "%.3f" % (max(0.0, dyn - float(r["cat_ms_per_token"])) / dyn)
                if r.get("gpu_tail_ms_last10") and r.get("cat_ms_last10"):
                    # Over the last steps: the copies save at most the device's tail.
                    end = float(r["ms_per_token_last10"])
                    saved = min(float(r["cat_ms_last10"]), float(r["gpu_tail_ms_last10"]))
                    floor += " [%.3f]" % (max(0.0, end - saved) / end)
            if ref is not None and ref["status"] == "ok":
                ratio = "%.3f" % (float(r["ms_per_token"]) / float(ref["ms_per_token"]))
                if r["peak_total_gib"] and float(ref["peak_total_gib"] or 0) > 0:
                    peak_ratio = "%.3f" % (float(r["peak_total_gib"]) /
                                           float(ref["peak_total_gib"]))
                same = "yes" if r["ids_sha256"] == ref["ids_sha256"] else \
                    "NO" + first_difference(folder, r, ref)
                if kind != "dynamic" and same.startswith("NO"):
                    differ += 1
            print("%-18s %5s %6s  %-9s %10s %8s %8s %10s %7s  %-15s %s" % (
                model, batch, tokens, kind, r["ms_per_token"], ratio,
                r["ms_per_token_last10"], r["peak_total_gib"] or "-", peak_ratio, same, floor),
                file=out)
    return differ


def first_difference(folder, row, ref):
    """" (token N)": the first generated token where the ids saved for two
    rows differ, where both were saved (--ids-out); else ""."""
    paths = [os.path.join(folder, x["ids_file"]) for x in (row, ref) if x.get("ids_file")]
    if len(paths) != 2 or not all(os.path.exists(p) for p in paths):
        return ""
    a, b = (torch.load(p) for p in paths)
    if a.shape != b.shape:
        return " (shapes)"
    prompt = int(row["prompt"])
    cols = (a != b).any(dim=0).nonzero().flatten()
    return " (token %d)" % (int(cols[0]) - prompt) if len(cols) else ""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarize", metavar="CSV", help="print the table of a CSV and exit")
    p.add_argument("--model", choices=("gpt2", "llama1b"), default="gpt2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=2048)
    p.add_argument("--cache", choices=CACHES, default="growable")
    p.add_argument("--max-cache-len", type=int,
                   help="StaticCache's length and GrowableCache's reservation (default: "
                   "2x the new tokens, at least prompt + new tokens)")
    p.add_argument("--static-compile", action="store_true",
                   help="let generate compile the model for StaticCache (off by default)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models, for the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", help="append the row to this CSV")
    p.add_argument("--ids-out", help="save the generated ids (torch.save); --summarize then "
                   "names the first token where a cache's ids differ from DynamicCache's")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="profile N steps early and N late in the run, by host time and, on "
                   "a GPU, by device time (tables on stderr; the run's times are then not "
                   "comparable)")
    p.add_argument("--sdpa", choices=SDPA_KERNELS, default="default",
                   help="hold scaled_dot_product_attention to one kernel (default: PyTorch's "
                   "choice)")
    args = p.parse_args(argv)
    if not args.summarize and (args.batch < 1 or args.prompt < 1 or args.new_tokens < 1):
        p.error("--batch, --prompt and --new-tokens must be positive")
    if args.cache == "static" and args.sdpa == "flash":
        p.error("--cache static with --sdpa flash: StaticCache attends over its whole length "
                "with the unwritten positions masked, and the flash kernel takes no mask; use "
                "--sdpa efficient (or default)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.summarize:
        differ = summarize(args.summarize)
        if differ:
            print("hf_generate: %d configuration(s) whose greedy outputs differ from "
                  "DynamicCache's" % differ)
        return 1 if differ else 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("hf_generate: no CUDA device; use --device cpu --tiny")
    row = run(args)
    if args.csv:
        append_rows(args.csv, COLUMNS, [row])
    print(" ".join("%s=%s" % (k, row.get(k, "")) for k in COLUMNS if row.get(k, "") != ""),
          flush=True)
    return 0 if row["status"] == "ok" else 2


if __name__ == "__main__":
    sys.exit(main())

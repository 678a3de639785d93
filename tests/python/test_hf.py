"""test_hf.py: tidalloc.hf.GrowableCache in transformers' generate on tiny
random models on the CPU (tidalloc's host backend): greedy outputs
identical to DynamicCache's (GPT-2, Llama with grouped-query attention and a
left-padded batch, Mistral with a sliding window), beam search (reorder in
place), prompt-lookup decoding (crop), and the layers' tensors views of
storage that never moves. Skipped without torch or transformers."""
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch", reason="tidalloc.hf needs torch (not installed here; "
                            "make test installs it into a cached virtual environment, "
                            "scripts/torch_venv.sh)")
transformers = pytest.importorskip("transformers", reason="tidalloc.hf needs transformers "
                                   "(not installed here; scripts/torch_venv.sh)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tidalloc import _lib  # noqa: E402

if _lib.backend(0) != "host":
    pytest.skip("these tests need tidalloc's host backend (TIDALLOC_CONF=backend:host)",
                allow_module_level=True)

from tidalloc.hf import GrowableCache, GrowableLayer, GrowableSlidingWindowLayer  # noqa: E402
from transformers import DynamicCache  # noqa: E402

VOCAB = 96
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=VOCAB,
             max_position_embeddings=256, num_attention_heads=4)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB,
                                  n_positions=256, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                                   **SMALL)
    return transformers.LlamaForCausalLM(cfg)


def mistral():
    cfg = transformers.MistralConfig(num_key_value_heads=2, sliding_window=6, bos_token_id=0,
                                     eos_token_id=1, **SMALL)
    return transformers.MistralForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama, "mistral": mistral}


def build(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    # Never stop early: every run produces its max_new_tokens.
    model.generation_config.eos_token_id = None
    return model


def generate(model, ids, mask, cache, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `past_key_values` is named `cache` in newer releases
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                              max_new_tokens=kwargs.pop("max_new_tokens", 30), do_sample=False,
                              pad_token_id=2, **kwargs)


def prompt(batch=2, length=9, left_pad=0, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if left_pad:
        ids[0, :left_pad], mask[0, :left_pad] = 2, 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_equals_dynamic_cache(name):
    model = build(name)
    ids, mask = prompt(left_pad=3 if name != "gpt2" else 0)
    ref = generate(model, ids, mask, DynamicCache())
    cache = GrowableCache(config=model.config)
    out = generate(model, ids, mask, cache)
    assert torch.equal(out, ref)
    # The cache held the model's keys and values: as views of storage at the
    # address of its first append, all tokens but the last one generated.
    kinds = {type(layer) for layer in cache.layers}
    assert kinds == ({GrowableSlidingWindowLayer} if name == "mistral" else {GrowableLayer})
    layer = cache.layers[0]
    assert layer.get_seq_length() == out.shape[1] - 1
    if name != "mistral":
        assert layer.keys.shape[2] == out.shape[1] - 1
        assert layer.keys.data_ptr() == layer.kv.data_ptrs()[0]
    else:
        # The ring keeps sliding_window - 1 tokens.
        assert len(layer.kv) == 6 and layer.keys.shape[2] == 5
    cache.close()


def test_cache_without_config_makes_its_layers():
    model = build("llama")
    ids, mask = prompt()
    cache = GrowableCache(max_cache_len=128)
    assert torch.equal(generate(model, ids, mask, cache), generate(model, ids, mask,
                                                                   DynamicCache()))
    assert len(cache.layers) == 2 and all(isinstance(x, GrowableLayer) for x in cache.layers)
    assert cache.layers[0].kv.max_len == 128


def test_beam_search_reorders_in_place():
    model = build("llama")
    ids, mask = prompt()
    calls = []
    cache = GrowableCache(config=model.config)
    original = GrowableLayer.reorder_cache

    def spy(self, beam_idx):
        ptr = self.kv.data_ptrs()[0]
        original(self, beam_idx)
        calls.append(self.keys.data_ptr() == ptr)

    GrowableLayer.reorder_cache = spy
    try:
        out = generate(model, ids, mask, cache, num_beams=3, max_new_tokens=12)
    finally:
        GrowableLayer.reorder_cache = original
    ref = generate(model, ids, mask, DynamicCache(), num_beams=3, max_new_tokens=12)
    assert torch.equal(out, ref)
    if calls:  # transformers versions that reorder the cache call it (in place)
        assert all(calls)


def test_prompt_lookup_decoding_crops():
    model = build("llama")
    # A repetitive prompt, so that prompt lookup proposes tokens (and the
    # cache is cropped when they are rejected).
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    mask = torch.ones_like(ids)
    crops = []
    original = GrowableLayer.crop

    def spy(self, n):
        crops.append(n)
        original(self, n)

    GrowableLayer.crop = spy
    try:
        out = generate(model, ids, mask, GrowableCache(config=model.config),
                       prompt_lookup_num_tokens=3, max_new_tokens=20)
    finally:
        GrowableLayer.crop = original
    ref = generate(model, ids, mask, DynamicCache(), max_new_tokens=20)
    assert torch.equal(out, ref)
    assert crops, "prompt lookup never cropped the cache"


def test_crop_both_meanings_and_errors():
    layer = GrowableLayer(max_cache_len=32)
    k = torch.randn(1, 2, 10, 8)
    layer.update(k, k)
    layer.crop(-3)
    assert layer.get_seq_length() == 7 and torch.equal(layer.keys, k[:, :, :7])
    layer.crop(5)  # the older meaning: the length to keep
    assert layer.get_seq_length() == 5
    with pytest.raises(NotImplementedError, match="does not offload"):
        layer.offload()
    cfg = transformers.LlamaConfig(**SMALL)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        GrowableCache(config=cfg)
    layer.close()


def test_hf_generate_benchmark_runs_on_the_cpu(tmp_path):
    """bench/torch/hf_generate.py's tiny models: one process per cache, rows
    in one CSV, and --summarize finds GrowableCache's and StaticCache's
    greedy outputs equal to DynamicCache's."""
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    script = os.path.join(root, "bench", "torch", "hf_generate.py")
    out = tmp_path / "hf.csv"
    env = dict(os.environ, TIDALLOC_CONF="backend:host", OMP_NUM_THREADS="1")
    for cache in ("dynamic", "growable", "static"):
        r = subprocess.run([sys.executable, script, "--tiny", "--device", "cpu", "--model",
                            "llama1b", "--batch", "2", "--prompt", "5", "--new-tokens", "12",
                            "--cache", cache, "--csv", str(out)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, script, "--summarize", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line.split() for line in r.stdout.splitlines()[1:]]
    assert sorted(x[3] for x in lines) == ["dynamic", "growable", "static"]
    # DynamicCache's row ends with the floor (the best a cache without
    # torch.cat can reach, as a multiple of DynamicCache's time per token),
    # after the ids' column.
    for x in lines:
        ids = x[-2] if x[3] == "dynamic" else x[-1]
        assert ids == "yes", r.stdout
    dynamic = next(x for x in lines if x[3] == "dynamic")
    assert 0.0 <= float(dynamic[-1]) <= 1.0, r.stdout  # no probe on the CPU: no [tail floor]


def test_hf_generate_refuses_static_cache_with_the_flash_kernel():
    """StaticCache masks its unwritten positions and the flash kernel takes no
    mask: the benchmark says so before building a model, not with PyTorch's
    'No available kernel' mid-generation."""
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    script = os.path.join(root, "bench", "torch", "hf_generate.py")
    r = subprocess.run([sys.executable, script, "--tiny", "--device", "cpu", "--cache", "static",
                        "--sdpa", "flash", "--new-tokens", "4"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "flash kernel takes no mask" in r.stderr and "--sdpa efficient" in r.stderr


def test_hf_generate_profiles_the_host_early_and_late(tmp_path):
    """--profile-steps N: a table of the host's operators over N steps from a
    tenth and from nine tenths of the run, and the row counts the steps."""
    import csv
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    out = tmp_path / "hf.csv"
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "torch", "hf_generate.py"),
                        "--tiny", "--device", "cpu", "--model", "gpt2", "--new-tokens", "30",
                        "--cache", "dynamic", "--profile-steps", "2", "--csv", str(out)],
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "early: steps 3-4" in r.stderr and "late: steps 27-28" in r.stderr, r.stderr
    assert "aten::cat" in r.stderr  # DynamicCache's growth shows among the operators
    with open(out) as f:
        assert next(csv.DictReader(f))["profiled_steps"] == "4"


def load_hf_generate():
    from repo_module import load
    return load("bench/torch/hf_generate.py")


def test_tail_floor_saves_at_most_the_devices_tail(tmp_path):
    """--summarize's last-10% floor: DynamicCache's time per token there,
    less the smaller of the copy it makes and the device's tail."""
    hf = load_hf_generate()
    base = dict(model="m", batch="8", new_tokens="8192", status="ok", peak_total_gib="1",
                ids_sha256="x", ms_per_token="10.0", cat_ms_per_token="1.0")
    rows = [dict(base, cache="dynamic", ms_per_token_last10="12.0", cat_ms_last10="2.0",
                 gpu_tail_ms_last10="0.5"),
            dict(base, cache="growable", ms_per_token_last10="11.6")]
    path = tmp_path / "hf.csv"
    for r in rows:
        hf.append_rows(str(path), hf.COLUMNS, [r])
    import io
    out = io.StringIO()
    assert hf.summarize(str(path), out) == 0
    dynamic = next(line for line in out.getvalue().splitlines() if " dynamic " in line)
    # floor over the run (10 - 1) / 10; over the last steps (12 - min(2, 0.5)) / 12
    assert dynamic.split()[-2:] == ["0.900", "[0.958]"], dynamic


def test_summary_names_the_first_token_that_differs_per_kernel(tmp_path):
    """With the ids saved beside the CSV, --summarize names the first
    generated token where a cache's ids part from DynamicCache's; rows held
    to a kernel (--sdpa) compare with DynamicCache's under the same kernel."""
    hf = load_hf_generate()
    prompt = 3
    ref = torch.arange(2 * 10).view(2, 10)
    other = ref.clone()
    other[1, prompt + 4] += 1  # the fifth generated token of the second sequence
    torch.save(ref, str(tmp_path / "dyn.pt"))
    torch.save(other, str(tmp_path / "grow.pt"))
    base = dict(model="m", batch="2", new_tokens="7", prompt=str(prompt), status="ok",
                peak_total_gib="1", ms_per_token="1.0", ms_per_token_last10="1.0")
    path = str(tmp_path / "hf.csv")
    for row in (dict(base, cache="dynamic", ids_sha256="a", ids_file="dyn.pt"),
                dict(base, cache="growable", ids_sha256="b", ids_file="grow.pt"),
                dict(base, cache="dynamic", ids_sha256="c", sdpa="flash"),
                dict(base, cache="growable", ids_sha256="c", sdpa="flash")):
        hf.append_rows(path, hf.COLUMNS, [row])
    import io
    out = io.StringIO()
    assert hf.summarize(path, out) == 1
    lines = out.getvalue().splitlines()
    default = next(line for line in lines if line.startswith("m ") and " growable " in line)
    assert "NO (token 4)" in default, out.getvalue()
    flash = next(line for line in lines if line.startswith("m/flash ") and " growable " in line)
    assert " yes" in flash, out.getvalue()


def test_step_clock_probes_only_on_a_gpu_and_keeps_the_last_tenth():
    hf = load_hf_generate()
    clock = hf.StepClock("cpu")
    for _ in range(40):
        clock(None, None)
    assert clock.tails == [] and clock.tail_ms_last10() == ""
    clock.tails = [(3, 0.010), (35, 0.002), (39, 0.004)]  # steps 36-39 are the last 10%
    assert clock.tail_ms_last10() == "4.0000"

"""validate.py: one validation program under one allocator, for
run_validation.sh. Prints one CSV row:
program,allocator,output_sha256,peak_allocated_mib,peak_reserved_mib,reserved_over_allocated,seconds

  gpt2: transformers GPT-2 (124M, random weights from its config, seed 0),
        greedy generation of 512 new tokens from a fixed 32-token prompt;
        the output is the generated token ids.
  vit:  timm vit_base_patch16_224 (random weights, seed 0), inference over
        batch sizes 1, 8, 32, 64, 17, 3; the output is every logit.

The allocator: native (PyTorch's default; PYTORCH_CUDA_ALLOC_CONF is the
caller's, e.g. expandable_segments:True), or tidalloc (installed before CUDA
starts). Peaks are torch.cuda.max_memory_allocated/reserved over the run,
which under tidalloc report tidalloc's figures."""
import hashlib
import sys
import time


def main():
    program, allocator = sys.argv[1], sys.argv[2]
    if allocator == "tidalloc":
        import tidalloc.torch
        tidalloc.torch.install()
    import torch
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    digest = hashlib.sha256()
    if program == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()
        prompt = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1)).to(dev)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=512, min_new_tokens=512, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(prompt))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        digest.update(out.cpu().numpy().tobytes())
    elif program == "vit":
        import timm
        model = timm.create_model("vit_base_patch16_224", pretrained=False).to(dev).eval()
        gen = torch.Generator().manual_seed(2)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            for batch in (1, 8, 32, 64, 17, 3):
                x = torch.randn(batch, 3, 224, 224, generator=gen).to(dev)
                digest.update(model(x).float().cpu().numpy().tobytes())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    else:
        sys.exit("validate.py: program gpt2 or vit")
    alloc = torch.cuda.max_memory_allocated()
    res = torch.cuda.max_memory_reserved()
    print("%s,%s,%s,%.1f,%.1f,%.4f,%.3f" % (program, allocator, digest.hexdigest()[:16],
                                             alloc / 2**20, res / 2**20, res / alloc, seconds))


if __name__ == "__main__":
    main()

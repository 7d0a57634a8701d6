"""Tiny random checkpoints (HF folders) of each supported variant, built fresh by tests.

Weights are drawn so activations are O(1) (transformers' 0.02-std init leaves logits and
attention nearly flat, which would make numeric comparisons weak).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Kiln compiles language models; héllo wörld, naïve café, 你好世界, こんにちは 🤗🚀✨ emoji.",
    "def f(x):\n    return x * 2  # numbers 0123456789 and symbols !@#$%^&*()",
] * 20

VARIANTS = {
    "llama": dict(model_type="llama"),
    "llama3": dict(model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, tie_word_embeddings=True),
    "llama-linear": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral", sliding_window=96),
    # Room for prompts that carry tool definitions (the tiny tokenizer spends ~1 token a byte).
    "llama-2k": dict(model_type="llama", max_position_embeddings=2048),
}


def make_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer (like SmolLM2's / Llama 3's) trained on a few lines,
    with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False}))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def make_checkpoint(folder: Path, variant: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write an HF folder: config.json, model.safetensors, tokenizer files."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    spec = dict(VARIANTS[variant])
    model_type = spec.pop("model_type")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    kwargs = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kwargs.update(spec)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    """transformers' own model for a checkpoint folder (the numeric reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def torch_greedy(module, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by Kiln's torch model (explicit KV)."""
    out = []
    with torch.no_grad():
        logits, past = module(torch.tensor([prompt_ids]), torch.arange(len(prompt_ids))[None])
        for i in range(steps):
            out.append(int(logits[0].argmax()))
            logits, past = module(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt_ids) + i]]), past)
    return out


def matmul_module(m: int, k: int, n: int):
    """A Relax module computing main(x [m, k], w [n, k]) = x @ w.T: one kernel to schedule."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, k], "float32"))
    w = relax.Var("w", relax.TensorType([n, k], "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x, relax.op.permute_dims(w))))
        bb.emit_func_output(out)
    return bb.get()


WORDS = "the quick brown fox jumps over a lazy dog Paris France capital".split()


def random_requests_free_every_page(engine, rng, count: int, max_tokens: int, n_choices: tuple[int, ...]) -> None:
    """Drive a foreground engine with ``count`` random requests (40% sharing a prefix, some
    with n > 1), stepping it a random 0-2 times between submissions and cancelling a live
    one 15% of the time; after every step the scheduler's ledger must agree with the cache's
    free pages, and when all is done (prefix holders released) every page is free."""
    shared = " ".join(rng.choices(WORDS, k=12))
    live = []

    def step():
        engine.step()
        assert engine.scheduler.ledger.free_pages == engine.cache.available_pages()

    for i in range(count):
        text = (shared + " " if rng.random() < 0.4 else "") + " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))
        live.append(engine.submit(text, max_tokens=rng.randint(1, max_tokens), n=rng.choice(n_choices),
                                  temperature=0.8, seed=i))
        for _ in range(rng.randint(0, 2)):
            if engine.core.has_work():
                step()
        if rng.random() < 0.15:
            rng.choice(live).cancel()
        live = [s for s in live if not s.done]
    while engine.core.has_work():
        step()
    engine.scheduler.check()
    for holder in engine.scheduler.prefix.holders():
        engine.cache.remove(holder)
    assert engine.cache.available_pages() == engine.cache.total_pages

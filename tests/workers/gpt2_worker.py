"""A transformers GPT-2 (tiny config, random init) built under auto_parallelize(embeddings=True):
every Conv1D an axonn_c.Conv1D, the token embedding an axonn_c.Embedding, lm_head tied to it;
loaded with the serial model's state dict and trained 10 AdamW steps, every rank its own
sequences: each step's loss equals serial training's within 1e-4 (tests/test_conv_multiproc.py).
The same for a tiny Llama with tied embeddings (every nn.Linear an axonn_c.Linear), and both
under auto_parallelize() without embeddings=True (a replicated embedding and tied head).
"""
import argparse
import os
import sys

import torch

import axonn_c
from common import train_as_serial
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

V, T = 96, 8


def config():
    return GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      attn_implementation="eager")


def llama_config():
    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       tie_word_embeddings=True, attn_implementation="eager")


def check_llama(g, seed, steps=10):
    what = f"Llama grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(llama_config())
    with axonn_c.auto_parallelize(embeddings=True):
        par = LlamaForCausalLM(llama_config())
    n = sum(isinstance(m, axonn_c.Linear) for m in par.model.modules())
    if n != 14:  # 7 projections a layer
        raise AssertionError(f"{what}: {n} of 14 projections parallel")
    if par.lm_head.weight is not par.model.embed_tokens.weight:
        raise AssertionError(f"{what}: lm_head is no longer tied to embed_tokens")
    load_and_train(g, ref, par, what, seed, steps)


def load_and_train(g, ref, par, what, seed, steps):
    """Loads the serial weights, then `steps` AdamW steps of both: equal losses, equal weights."""
    par.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(seed)

    def batches(step):  # every rank's token ids (its own labels)
        return [torch.randint(0, V, (2, T), generator=gen) for _ in range(g.world_size)]

    train_as_serial(g, ref, par, what, batches, lambda m, i: m(input_ids=i, labels=i).loss,
                    steps=steps, lr=1e-3)


def check_gpt2(g, seed, steps=10):
    what = f"GPT-2 grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x{g.G_intra_d} rank {g.rank}"
    torch.manual_seed(seed)
    ref = GPT2LMHeadModel(config())
    with axonn_c.auto_parallelize(embeddings=True):
        par = GPT2LMHeadModel(config())
    convs = [m for m in par.modules() if isinstance(m, (Conv1D, axonn_c.Conv1D))]
    if not convs or not all(type(m) is axonn_c.Conv1D for m in convs):
        raise AssertionError(f"{what}: Conv1D kept: {[type(m).__name__ for m in convs]}")
    if type(Conv1D(4, 4)) is not Conv1D:
        raise AssertionError(f"{what}: transformers' Conv1D not restored after the context")
    if not isinstance(par.transformer.wte, axonn_c.Embedding):
        raise AssertionError(f"{what}: wte is {type(par.transformer.wte).__name__}")
    if par.lm_head.weight is not par.transformer.wte.weight:
        raise AssertionError(f"{what}: lm_head is no longer tied to wte")
    load_and_train(g, ref, par, what, seed, steps)


def check_replicated_heads(g, seed, steps=3):
    """auto_parallelize() without embeddings=True: the embedding stays torch's, and the output
    layer tied to it (transformers' tie_weights assigns it the table) becomes a replicated torch
    nn.Linear sharing it (was: an axonn_c.Linear holding the whole table as its flat shard, whose
    load_state_dict and forward failed)."""
    for name, model in (("GPT-2", lambda: GPT2LMHeadModel(config())),
                        ("Llama", lambda: LlamaForCausalLM(llama_config()))):
        what = (f"{name} (replicated embedding) grid {g.G_data}x{g.G_intra_r}x{g.G_intra_c}x"
                f"{g.G_intra_d} rank {g.rank}")
        torch.manual_seed(seed)
        ref = model()
        with axonn_c.auto_parallelize():
            par = model()
        emb = par.get_input_embeddings()
        if type(par.lm_head) is not torch.nn.Linear or par.lm_head.weight is not emb.weight:
            raise AssertionError(f"{what}: lm_head is {type(par.lm_head).__name__}, tied: "
                                 f"{par.lm_head.weight is emb.weight}")
        load_and_train(g, ref, par, what, seed, steps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--grids", required=True, help="G_data x r x c x d items: 1x2x2x1,...")
    a = p.parse_args()
    todo = [tuple(int(v) for v in s.split("x")) for s in a.grids.split(",")]
    for n, sizes in enumerate(todo):
        g = axonn_c.init(G_data=sizes[0], G_intra_r=sizes[1], G_intra_c=sizes[2],
                         G_intra_d=sizes[3])
        check_gpt2(g, seed=500 + n)
        check_llama(g, seed=600 + n)
        check_replicated_heads(g, seed=700 + n)
        axonn_c.finalize()
    if int(os.environ["RANK"]) == 0:
        print(f"world {os.environ['WORLD_SIZE']}: {len(todo)} grids, GPT-2 and Llama train as "
              "serial")
    return 0


if __name__ == "__main__":
    sys.exit(main())

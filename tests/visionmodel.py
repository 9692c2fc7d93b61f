"""A tiny Gemma 3 vision projector (mmproj GGUF) with random weights, for a text model of width `n_embd_text`.

mtmd (llama.cpp's multimodal library) loads it as it loads Gemma 3's real projector: a SigLIP-style ViT
(patch embedding, learned positions, pre-norm blocks with GELU), an average pool of `merge` × `merge`
patches, Gemma's soft-embedding RMS norm and the input projection to the text model's width. Paired with
gemma-3-270m (width 640), it makes a real text model read images: each image becomes
((image_size / patch) / merge)² tokens between <start_of_image> and <end_of_image>, as Gemma 3 does with
256. Written in milliseconds; the weights are random, so the answers are only reproducible, not sensible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gemma3_mmproj(path: Path, *, n_embd_text: int = 640, image_size: int = 32, patch: int = 4,
                        merge: int = 2, n_embd: int = 32, n_head: int = 2, n_ff: int = 64, n_layer: int = 2,
                        seed: int = 7) -> Path:
    import gguf

    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    n_patches = (image_size // patch) ** 2
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("general.name", "tiny-gemma3-mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.projector.scale_factor", merge)
    # numpy shapes are the reverse of ggml's ne: the patch embedding is a conv kernel (n_embd, 3, p, p)
    w.add_tensor("v.patch_embd.weight", rand(n_embd, 3, patch, patch))
    w.add_tensor("v.patch_embd.bias", rand(n_embd))
    w.add_tensor("v.position_embd.weight", rand(n_patches, n_embd))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", rand(n_embd, n_embd))
            w.add_tensor(f"v.blk.{i}.{name}.bias", rand(n_embd, scale=0.02))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", np.ones(n_embd, np.float32))
            w.add_tensor(f"v.blk.{i}.{name}.bias", np.zeros(n_embd, np.float32))
        w.add_tensor(f"v.blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"v.blk.{i}.ffn_up.bias", rand(n_ff, scale=0.02))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(f"v.blk.{i}.ffn_down.bias", rand(n_embd, scale=0.02))
    w.add_tensor("v.post_ln.weight", np.ones(n_embd, np.float32))
    w.add_tensor("v.post_ln.bias", np.zeros(n_embd, np.float32))
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(n_embd, np.float32))
    # ggml ne [n_embd_text, n_embd]: mtmd reads the text width from ne[0]
    w.add_tensor("mm.input_projection.weight", rand(n_embd, n_embd_text, scale=1.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

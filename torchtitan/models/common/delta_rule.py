"""The gated delta rule (gated DeltaNet's recurrence, Qwen3.5 / Qwen3-Next), in PyTorch, on every device.

Per head, a state S [dk, dv] is carried along the sequence. At token t, with key k, value v, query q,
decay g <= 0 (a log factor) and write strength beta in (0, 1):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t

(the state decays, forgets what it held along k_t, and writes v_t there). `recurrent` runs it token
by token: the reference, and generation's one-token step. `chunked` computes the same thing in
chunks of C tokens with matrix products (the training path, differentiable by autograd), carrying
the state between chunks in float32. Within a chunk starting from S_0, with G the cumulative sum of
g in the chunk, every S_i is exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j w_j^T for vectors w_j that
solve a unit lower-triangular system:

    (I + A) W = beta * (V - exp(G) * (K S_0)),    A_ij = beta_i exp(G_i - G_j) k_i^T k_j  (j < i)

so W = U - Wk S_0 with U and Wk solved once per chunk for all chunks at once; then

    O = exp(G) * (Q S_0) + (M * Q K^T) W,    M_ij = exp(G_i - G_j)  (j <= i)
    S_C = exp(G_C) S_0 + (exp(G_C - G) * K)^T W.

Only the last two lines run chunk after chunk. Documents (block-causal training): `doc_ids` [batch, seq]
(non-decreasing along each row) start every document from a zero state: the masks drop pairs of
tokens from different documents, and the carried state reaches only the tokens of the document it
belongs to. `causal_conv` is the depthwise causal convolution before the rule, which likewise does not
reach across a document start.
"""

import torch
import torch.nn.functional as F


def recurrent(q, k, v, g, beta, state=None, doc_ids=None):
    """Token by token. q, k [batch, seq, heads, dk], v [batch, seq, heads, dv], g, beta [batch, seq,
    heads]; `state` [batch, heads, dk, dv] (None: zeros). Returns (o [batch, seq, heads, dv] in v's
    dtype, the final state in float32)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(b, h, dk, dv, dtype=torch.float32) if state is None else state.float()
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    out = []
    for i in range(t):
        if doc_ids is not None and i > 0:
            new_doc = (doc_ids[:, i] != doc_ids[:, i - 1]).float()[:, None, None, None]
            s = s * (1 - new_doc)
        s = s * g[:, i].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", s, k[:, i])
        s = s + k[:, i, :, :, None] * (beta[:, i, :, None] * (v[:, i] - remembered))[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
    return torch.stack(out, dim=1).to(v.dtype), s


def chunked(q, k, v, g, beta, chunk: int = 64, state=None, doc_ids=None):
    """The same as `recurrent`, in chunks of `chunk` tokens (module docstring), in float32."""
    b, t, h, dk = k.shape
    dv, dtype = v.shape[-1], v.dtype
    pad = -t % chunk
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if doc_ids is None:
        doc_ids = torch.zeros(b, t, dtype=torch.long, device=k.device)
    if pad:  # padding tokens at the end: no decay (g 0), no write (beta 0), so the final state is the last token's
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        doc_ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(b, pad)], dim=1)
    n = (t + pad) // chunk
    # [batch, heads, chunks, chunk, ...]
    q, k, v = (x.view(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.view(b, n, chunk, h).permute(0, 3, 1, 2) for x in (g, beta))
    doc = doc_ids.view(b, 1, n, chunk)
    G = g.cumsum(-1)
    same = doc[..., :, None] == doc[..., None, :]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    # exp(G_i - G_j) for j <= i in the same document, else 0 (masked before exp: no overflow).
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~(causal & same), float("-inf")).exp()
    strict = decay.masked_fill(torch.eye(chunk, dtype=torch.bool, device=k.device), 0.0)
    a = beta[..., None] * strict * (k @ k.transpose(-1, -2))
    system = a + torch.eye(chunk, device=k.device)
    # The tokens that continue the document the carried state belongs to: the one before the chunk (the
    # window's first document for `state`, which the caller carries over from before the window).
    before = torch.cat([doc[..., :1, 0], doc[..., :-1, -1]], dim=-1)  # [batch, 1, chunks]
    carry = (doc == before[..., None]).float()  # [batch, 1, chunks, chunk]
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    wk = torch.linalg.solve_triangular(system, (beta * G.exp() * carry)[..., None] * k, upper=False, unitriangular=True)
    scores = decay * (q @ k.transpose(-1, -2))
    q_carry = (G.exp() * carry)[..., None] * q
    # What each chunk's last token keeps of its own chunk's keys, and of the state before it.
    last_doc = doc[..., -1:]
    keep = ((G[..., -1:] - G).exp() * (doc == last_doc).float())[..., None] * k
    keep_state = G[..., -1].exp() * (doc[..., -1] == before).float()  # the chunk continues that document throughout
    s = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    out = []
    # unbind once: indexing chunk c in the loop would make each backward step zero-fill a whole tensor.
    per_chunk = zip(*(t.unbind(2) for t in (u, wk, q_carry, scores, keep, keep_state)))
    for u_c, wk_c, q_c, scores_c, keep_c, keep_state_c in per_chunk:
        w = u_c - wk_c @ s
        out.append(q_c @ s + scores_c @ w)
        s = keep_state_c[..., None, None] * s + keep_c.transpose(-1, -2) @ w
    o = torch.stack(out, dim=2).permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, dv)
    return o[:, :t].to(dtype), s


FLA_INSTALL = "pip install flash-linear-attention"


def fla_chunked(q, k, v, g, beta, doc_ids=None):
    """`chunked` (no carried state) through flash-linear-attention's Triton kernel (CUDA only; optional:
    model.delta_rule_kernel = "fla"). q arrives normalized and scaled, so the kernel's own scale is 1. Its
    varlen form takes one row of concatenated sequences with their boundaries (cu_seqlens): the batch's rows
    are joined, cut at every row start and, under block-causal masks, at every document start, which
    restarts the state as the project's kernel does. Returns (o in v's dtype, None: no final state)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # pyrefly: ignore[missing-import]  # optional, CUDA only (FLA_INSTALL)

    b, t = k.shape[:2]
    starts = torch.zeros(b, t, dtype=torch.bool, device=k.device)
    starts[:, 0] = True
    if doc_ids is not None:
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = starts.reshape(-1)
    cu_seqlens = torch.cat([flat.nonzero().squeeze(1), flat.new_tensor([b * t], dtype=torch.long)])
    q, k = q.to(v.dtype), k.to(v.dtype)  # the kernel takes q, k and v in one dtype
    joined = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(
        *joined, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=cu_seqlens
    )
    return o.reshape(v.shape).to(v.dtype), None


def causal_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids=None) -> torch.Tensor:
    """Depthwise causal convolution: x [batch, seq, channels], weight [channels, kernel]; out_t =
    sum_s weight[:, -1 - s] * x_{t-s} over the earlier tokens of the same document (zeros before
    the window or the document)."""
    kernel, seq = weight.shape[-1], x.shape[1]
    out = x * weight[:, -1]
    for s in range(1, kernel):
        shifted = F.pad(x, (0, 0, s, 0))[:, :seq]  # x_{t-s}, zeros before the start (also where seq <= s)
        if doc_ids is not None:
            same = F.pad(doc_ids[:, s:] == doc_ids[:, :-s], (s, 0), value=False)[:, :seq]
            shifted = shifted * same[..., None].to(x.dtype)
        out = out + shifted * weight[:, -1 - s]
    return out

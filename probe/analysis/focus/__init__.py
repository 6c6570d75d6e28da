r"""Per-head focus statistics and head roles: every metric defined here, once.

``probe.head_stats(cache_or_caches) -> HeadStats`` gives one row per (stack, layer, head, kind)
(or ``probe.head_stats(model, inputs)``: computed while the model runs, block by block);
``probe.induction_scores(model)`` scores heads on repeated random tokens;
``probe.retrieval_scores(model, lengths, depths)`` on a needle planted in filler text. This
docstring is the one place the metrics are defined (the README links here).

Conventions (all metrics)
-------------------------
* A pattern row is a query i; ``a_ij`` is its weight on key j (query → key). For causal layers
  the visible keys of i are the real keys j ≤ i; otherwise every real key. A layer counts as causal
  when every weight above the diagonal (between real tokens) is exactly zero.
* Padding is excluded on both sides from ``metadata["attention_mask"]`` (``target_attention_mask``
  for an encoder-decoder's decoder): padded queries are not counted, weight on padded keys is
  dropped.
* **Counted queries**: real queries with at least two visible keys (so the first query of a
  causal layer, whose single weight is forced to 1, never counts).
* Each metric is averaged over the counted queries of a text; over several texts (a batch, a list
  of caches) the table holds the mean over texts and ``<metric>_std``, the sample standard
  deviation across texts, merged streaming with :class:`RunningStats` (Chan et al.). NaN means
  undefined (no counted query, no ids, cross-attention, ...).
* Cross-attention rows get only the metrics marked "all"; offsets, distances, words and templates
  are for self-attention ("self").

Metrics
-------
Besides the metrics, each row has ``stack``, ``layer``, ``head`` (the model's head index, also
when only some heads were captured), ``kind`` (self/cross), ``kv_head``, ``causal``,
``n_texts`` (texts that defined the row's metrics), ``role`` and ``roles``.

==================  ======  ==================================================================
column              kinds   definition (source)
==================  ======  ==================================================================
entropy             all     H_i = −Σ_j a_ij log a_ij, in nats (Clark et al. 2019)
norm_entropy        all     H_i / log n_i with n_i visible keys: 1 = uniform, comparable across
                            causal rows of different lengths (Clark et al. 2019)
confidence          all     max_j a_ij, excluding the end token as a query: the last real token
                            when it is a special token ([SEP], </s>, EOS) (Voita et al. 2019)
first               all     a_i,f with f the first real key: first-token / sink mass (Gu et al.
                            2024; ``HeadStats.sink_rate`` = share of heads with first > ε = 0.3)
special             all     Σ a_ij over special keys from ``metadata["special_tokens_mask"]``
                            ([CLS], [SEP], BOS, EOS)
punct               all     Σ a_ij over punctuation keys (display token made only of Unicode P*)
content             all     Σ a_ij over keys that are neither the first token nor special:
                            attention to content, reported apart from the sink
span                all     effective span: the fewest keys whose largest weights cover 90% of
                            the row's mass
prev / self / next  self    a_i,i−1 / a_ii / a_i,i+1, over queries whose key i−1 / i / i+1 is
                            visible (``next`` is NaN in causal layers)
local               self    Σ_{|i−j|≤2} a_ij
distance            self    Σ_j a_ij |i − j| (mean attention distance, in tokens)
signed_distance     self    Σ_j a_ij (j − i): negative = looks back
pos_offset          self    the most frequent offset argmax_j a_ij − i over the counted queries
                            (a row whose maximum is tied takes its first key)
                            (per text; over texts it is averaged like every metric, and its
                            ``_std`` shows whether the offset is the same in every text)
pos_frac            self    the share of counted queries whose argmax sits at ``pos_offset``;
                            a *positional* head has pos_frac ≥ 0.9 (Voita et al. 2019)
word_prev/self/next self    prev/self/next masses on the word-level pattern: attention *to* a
                            word is summed over its pieces, *from* a word averaged over its
                            pieces (Clark et al. 2019). Words come from the display tokens:
                            WordPiece ``##`` pieces continue a word; in leading-space schemes
                            (byte BPE / SentencePiece `` the``, character tokenizers) a piece
                            starting with whitespace, or following a whitespace piece, starts a
                            word; otherwise each token is a word; special tokens are words of
                            their own. Causal layers skip the first word as a query
prev_score          self    Σ(A⊙D)/ΣA with D_ij = [j = i−1] ("mul" form; TransformerLens
                            ``detect_head`` with exclude_bos = exclude_current_token = False;
                            ΣA over real queries and keys, the first query included)
dup_score           self    same with D_ij = [id_i = id_j, j < i] (duplicate token)
induction_score     self    same with D_ij = [id_i = id_{j−1}, j ≤ i] (induction, Olsson et al.)
dup_prefix          self    prefix-matching form: Σ_j D_ij a_ij averaged over the queries that
                            have at least one match (duplicate template)
induction_prefix    self    the same for the induction template: attention to the token after an
                            earlier occurrence of the current token (Olsson et al. 2022)
dup_matches         self    the number of queries with at least one duplicate match, summed over
induction_matches           texts (the support behind the prefix scores)
beyond_16/128/1024  self    Σ_{|i−j|>D} a_ij: the mass further than D tokens away (long context:
                            how much a head reads from afar)
reach90             self    the smallest distance d with Σ_{|i−j|≤d} a_ij ≥ 0.9 Σ_j a_ij: the
                            distance within which 90% of the row's mass lies
distance_px         self    images: Σ_j a_ij ‖c_i − c_j‖ over the patch keys j of query i's
                            picture, c the patch centres in input pixels, averaged over patch
                            queries (class, register and text rows and columns left out, weights
                            not renormalised): the mean attention distance of Dosovitskiy et al.
                            2020, Fig. 7. NaN without an image grid; whole patterns only
on_class            self    images: Σ a_ij over class keys ([CLS], DeiT's [DIST]), over every
                            counted query (NaN when the stack has no class token)
on_register         self    images: Σ a_ij over register keys (Darcet et al. 2024), the same way
on_image            self    vision-language models: Σ a_ij over image-token keys, over the text
                            queries that can see an image position (in a causal layer, text
                            after the first image token): the share of a word's attention that
                            lands on the picture. NaN without text beside an image
==================  ======  ==================================================================

By contribution: a cache of ``probe.contributions`` also holds each head's contributions,
``c_ij = ||a_ij v_j W_O^h||`` (Kobayashi et al. 2020). Every metric is computed on them too, each
row renormalised to sum 1 in place of ``a_ij``: ``HeadStats.by_contribution`` is that table, and
``first_contrib`` and ``distance_contrib`` (its ``first`` and ``distance``) stand beside those by
weight. Every cache added must hold contributions, else they are left out (``not_computed``).

Attention rollout (Abnar & Zuidema 2020): per stack, ``Â_l = 0.5·mean_h W_l + 0.5·I`` (padded rows
identity), ``R = Â_L ··· Â_1``; ``HeadStats.rollout[stack]`` is ``[batch, T, T]`` for a single
cache captured with all heads (rollout is per text; it is not averaged across caches).

Sink profile (a column statistic): ``HeadStats.received["stack/layer/kind"]`` is ``[batch,
heads, K]``, the mean weight each key position receives over the counted queries of a text
(Xiao et al. 2024's attention sinks show up as a spike at the first positions);
``HeadStats.sink_profile(layer)`` averages it over texts. Like the rollout it is kept for a single
cache or model run. ``probe.head_stats(model, inputs)`` computes every metric and the sink profile
while the model runs, a block of query rows at a time (``docs/long-context.md``).

Roles (:data:`ROLE_RULES`, on the means over texts; the first that holds is ``role``, all that
hold are ``roles``): induction (induction_prefix ≥ 0.4), duplicate-token (dup_prefix ≥ 0.4),
both only with at least 5 matching queries in all (``MIN_MATCHES``),
previous-token (prev ≥ 0.5), next-token (next ≥ 0.5), self (self ≥ 0.5), broad/uniform
(norm_entropy ≥ 0.9), sink (first > 0.3), positional (pos_frac ≥ 0.9), local (local ≥ 0.7),
else none. Grouped-query models (``num_key_value_heads`` < ``num_attention_heads`` in the
recorded config) get ``kv_head`` = head // (heads per key/value head) and ``HeadStats.kv_groups``.
"""

from probe.analysis.focus.accumulator import FocusAccumulator
from probe.analysis.focus.definitions.roles import roles_of
from probe.analysis.focus.definitions.running import RunningStats
from probe.analysis.focus.definitions.table import METRICS, ROLE_RULES, SINK_EPSILON
from probe.analysis.focus.induction import induction_scores, repeated_sequences
from probe.analysis.focus.result import HeadStats
from probe.analysis.focus.retrieval import retrieval_scores
from probe.analysis.focus.stats import head_stats

__all__ = [
    "head_stats",
    "HeadStats",
    "FocusAccumulator",
    "RunningStats",
    "induction_scores",
    "retrieval_scores",
    "repeated_sequences",
    "METRICS",
    "ROLE_RULES",
    "SINK_EPSILON",
    "roles_of",
]

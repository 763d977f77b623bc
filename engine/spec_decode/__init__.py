"""Speculative decoding without a draft model (plain Python, no torch).

``ngram`` proposes a request's next tokens from its own prompt and output (prompt lookup, one
incremental index per request, nothing shared across requests); ``policy`` decides how many of
them each step verifies (from the step-cost table measured at start-up and each request's
acceptance so far); ``verify`` lays the drafted positions out as sampling rows and keeps the
drafts that the sampled tokens confirm (sample-then-match, lossless). A structured-output
request's drafts (its grammar's forced tokens, composed with the n-gram ones) and the mask rows
that verify them live with the grammar matchers, in ``structured/drafts.py``. ``speculator``
is what the engine core (``core/llm_engine.py``) calls: drafts before a step, the kept runs after
it; the scheduler only sees how many draft tokens a decode sequence brings
(``Sequence.draft_token_ids``). How many rows a step may verify bit for bit is the executor's
answer (``exact_rows``): nothing here imports the model's layers, models or kernels.
"""

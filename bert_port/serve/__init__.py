"""`bert-port-serve`: the model behind HTTP, with TEI's and OpenAI's request and response bodies.

Routes parse, validate and queue (`app.py`); one inference loop per model batches what is
waiting by token budget and calls the library's own `SentenceEncoder` or predictor
(`batching.py`), so a response has the bits the library gives the same input alone.
"""

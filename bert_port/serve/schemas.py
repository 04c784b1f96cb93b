"""Request bodies, as TEI and OpenAI name their fields (pydantic models: FastAPI validates them
and documents them at /docs). Unknown fields are ignored, as TEI's serde does."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Direction = Literal["Right", "Left", "right", "left"]


class EmbedRequest(BaseModel):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    dimensions: int | None = Field(default=None, ge=1)


class EmbedAllRequest(BaseModel):
    inputs: str | list[str]
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class PredictRequest(BaseModel):
    # A text, a pair [text, text], or a batch of [text] and [text, text] items (TEI's PredictInput).
    inputs: str | list[str] | list[list[str]]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class RerankRequest(BaseModel):
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "Right"


class TokenizeRequest(BaseModel):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(BaseModel):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class OpenAIEmbeddingRequest(BaseModel):
    # A text, texts, one sequence of token ids, or several.
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

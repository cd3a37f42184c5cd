"""The structured-output paths of the client libraries people use, against the real server on the
demo model: LangChain (json_schema, and the Responses API), instructor (JSON and TOOLS modes) and
pydantic-ai (NativeOutput). Each gets a schema-valid object back."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from vlmserve.config import DEFAULT_MODEL_NAME

ASK = "Describe one shape you like."


class Shape(BaseModel):
    shape: Literal["circle", "square", "triangle", "star"]
    colour: Literal["red", "green", "blue", "yellow", "purple"]
    count: int = Field(ge=0, le=9)


@pytest.fixture
def base_url(demo_server):
    return demo_server.url + "/v1"


def test_langchain_with_structured_output(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=DEFAULT_MODEL_NAME, base_url=base_url, api_key="unused", temperature=0, max_tokens=80)
    assert isinstance(llm.with_structured_output(Shape, method="json_schema").invoke(ASK), Shape)


def test_langchain_over_the_responses_api(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=DEFAULT_MODEL_NAME, base_url=base_url, api_key="unused", temperature=0, max_tokens=80,
                     use_responses_api=True)
    reply = llm.invoke("Hello!")
    assert reply.text and reply.response_metadata.get("status") == "completed"
    assert isinstance(llm.with_structured_output(Shape, method="json_schema").invoke(ASK), Shape)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(base_url, mode):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    shape = client.chat.completions.create(model=DEFAULT_MODEL_NAME, response_model=Shape, max_retries=0,
                                           messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=80)
    assert isinstance(shape, Shape)


def test_pydantic_ai_native_output(base_url):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(DEFAULT_MODEL_NAME, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(model, output_type=NativeOutput(Shape), model_settings={"temperature": 0, "max_tokens": 80})
    assert isinstance(agent.run_sync(ASK).output, Shape)

"""A module fixture for test files whose shardlm runs all read one tokenizer directory: import
`template_parsed_once` into the test module and its chat template is parsed once per module."""

from __future__ import annotations

import functools

import pytest

from shardlm.sft.template import ChatTemplate


@pytest.fixture(scope="module", autouse=True)
def template_parsed_once():
    """The module's runs read the same chat template (an 11 MB tokenizer.json, 0.6 s of CPU a parse): parsed at the
    first run, reused by the next ones."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChatTemplate, "from_dir", classmethod(functools.cache(ChatTemplate.from_dir.__func__)))
        yield

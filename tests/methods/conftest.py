"""The tiny Qwen2 the method tests' trainer runs load (one per package run)."""

import pytest

from conftest import tiny_hf_model


@pytest.fixture(scope="package")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_methods")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return str(path)

"""Hyperpartisan as the authors split and clean it (`memoria_ds/data/hyperpartisan.py`), offline: the lists,
the text, the splits of a synthetic 645, the CLI copy read by the classification data loader, the refusals."""

from __future__ import annotations

import datasets
import pytest

from memoria_ds.data import hyperpartisan as hp
from memoria_ds.data.evidence_documents import write_book_tokenizer
from memoria_ds.data.labelled import load_labelled_documents


def test_the_authors_lists_and_their_overlap():
    lists = hp.HYPERPARTISAN_SPLITS
    assert {k: len(v) for k, v in lists.items()} == {"train": 516, "validation": 64, "test": 65}
    assert lists["train"][:4] == [239, 342, 401, 424] and lists["validation"][:3] == [182, 438, 545]
    assert lists["test"][:3] == [537, 517, 23] and lists["test"][-1] == 147
    assert all(len(set(v)) == len(v) for v in lists.values())  # no index twice within a split
    assert hp.split_overlap() == {"test&train": 51, "test&validation": 7, "validation&train": 0}
    assert max(max(v) for v in lists.values()) < hp.NUM_ARTICLES


@pytest.mark.parametrize("html, text", [
    ("<p>One <b>bold</b> word.</p>", "One bold word."),
    ("<p>a</p>\n\n<p>b</p>", "a b"),  # whitespace between paragraphs: one space
    ("<p>Tom &amp; Jerry&#39;s &quot;show&quot;</p>", "Tom & Jerry's \"show\""),
    ("x&nbsp;&nbsp;y", "x y"),  # no-break spaces are whitespace to Python's \s, as in the authors' re.sub
    ("<p>kept<!-- a comment --> text</p>", "kept text"),  # comments are not text (BeautifulSoup's get_text)
    ("line<br/>next", "linenext"),  # a tag is not a space
    ("\t <p> padded </p> \n", " padded "),  # runs collapse, nothing is stripped
    ("<a href='u'>link</a> and <q>quote</q>", "link and quote"),
])
def test_clean_text_is_the_html_text_with_whitespace_runs_made_one_space(html, text):
    assert hp.clean_text(html) == text


def articles(n: int = hp.NUM_ARTICLES) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [f"<p>article {i}</p>\n<p>its  end</p>" for i in range(n)],
                                       "hyperpartisan": [i % 3 == 0 for i in range(n)],
                                       "title": [f"t{i}" for i in range(n)]})


def test_the_splits_are_the_lists_articles_in_order():
    splits = hp.hyperpartisan_splits(articles())
    for name, indices in hp.HYPERPARTISAN_SPLITS.items():
        ds = splits[name]
        assert ds["article"] == indices
        assert ds["text"] == [f"article {i} its end" for i in indices]
        assert ds["label"] == [int(i % 3 == 0) for i in indices]
        assert ds.features["label"].names == ["false", "true"]


def test_a_source_that_is_not_the_645_articles_is_refused():
    with pytest.raises(ValueError, match="has 645 articles; this source has 644"):
        hp.hyperpartisan_splits(articles(644))
    with pytest.raises(ValueError, match="'hyperpartisan' is missing"):
        hp.hyperpartisan_splits(articles().remove_columns("hyperpartisan"))


def test_the_cli_copy_is_read_by_the_classification_loader(tmp_path, capsys):
    raw = tmp_path / "articles.parquet"
    articles().to_parquet(str(raw))
    out = tmp_path / "hp"
    assert hp.main([str(out), "--source", str(raw)]) == 0
    assert "train 516, validation 64, test 65" in capsys.readouterr().out
    assert hp.load_hyperpartisan(out)["test"]["article"] == hp.HYPERPARTISAN_SPLITS["test"]  # returned as written
    docs = load_labelled_documents(path=str(out), tokenizer=write_book_tokenizer(tmp_path / "tok"),
                                   splits=("train", "validation", "test"))
    assert [docs[s].num_documents for s in ("train", "validation", "test")] == [516, 64, 65]
    assert docs["train"].label_names == ["false", "true"]
    assert hp.main([str(tmp_path / "x"), "--source", str(tmp_path / "missing.parquet")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_named_source_without_the_hub_says_how_to_supply_a_copy(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"could not be loaded from the hub .*python -m memoria_ds.data.hyperpartisan"):
        load_labelled_documents(path="hyperpartisan", tokenizer=None, splits=("train",))

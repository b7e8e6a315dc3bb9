"""Hyperpartisan as the authors split and clean it (`memoria_ds/data/hyperpartisan.py`), offline: the lists,
the text (hand-written values, and BeautifulSoup itself where it is installed), the splits of a synthetic 645,
the hub's addressing, the CLI copy read by the classification data loader, the refusals."""

from __future__ import annotations

import random
import re

import datasets
import pytest

from memoria_ds.data import hyperpartisan as hp
from memoria_ds.data.evidence_documents import write_book_tokenizer
from memoria_ds.data.labelled import load_labelled_documents


def test_the_authors_lists_and_their_overlap():
    lists = hp.HYPERPARTISAN_SPLITS
    assert {k: len(v) for k, v in lists.items()} == {"train": 516, "validation": 64, "test": 65}
    assert lists["train"][:4] == [239, 342, 401, 424] and lists["train"][-2:] == [135, 460]
    assert lists["validation"][:3] == [182, 438, 545] and lists["validation"][-1] == 177
    assert lists["test"][:3] == [537, 517, 23] and lists["test"][-1] == 147
    assert all(len(set(v)) == len(v) for v in lists.values())  # no index twice within a split
    assert hp.split_overlap() == {"test&train": 51, "test&validation": 7, "validation&train": 0}
    assert max(max(v) for v in lists.values()) < hp.NUM_ARTICLES


CASES = [
    ("<p>One <b>bold</b> word.</p>", "One bold word."),
    ("<div><p>a <i>b <b>c</b></i> d</p></div>", "a b c d"),  # nested tags
    ("<p>a</p>\n\n<p>b</p>", "a b"),  # whitespace between paragraphs: one space
    ("<p>Tom &amp; Jerry&#39;s &quot;show&quot;</p>", "Tom & Jerry's \"show\""),
    ("x&nbsp;&nbsp;y", "x y"),  # bs4 gives U+00A0, which Python's \s matches: collapsed with its neighbours
    ("x&nbsp;y", "x y"),
    ("<p>kept<!-- a comment --> text</p>", "kept text"),  # comments are not get_text()'s
    ("line<br/>next<br>last", "linenextlast"),  # a tag is not a space
    ("\t <p> padded </p> \n", " padded "),  # runs collapse, nothing is stripped
    ("a\r\n\tb\x0bc", "a b c"),
    ("<a href='u'>link</a> and <q>quote</q>", "link and quote"),
    ("a<script>var x = '<p>';</script>b<style>p {}</style>c", "abc"),  # bs4 >= 4.9: not text
    ("a<template>t<b>u</b></template>b<ruby>c<rp>(</rp><rt>C</rt><rp>)</rp></ruby>", "abc"),
    ("<b><rt>x</b>y", "y"),  # </b> closes the <rt> opened inside it, as in bs4's tag stack
    ("a<![CDATA[ c ]]>b", "a c b"),  # a CDATA section is text to bs4
    ("<!DOCTYPE html><?php x ?>a", "a"),
    ("&#150; &#x41; &copy 2019, AT&T rocks", "\u2013 A \u00a9 2019, AT&T rocks"),  # windows-1252 below 256, as bs4
    ("&unknown; &notit;", "&unknown &notit"),  # bs4 drops an unknown entity's ";" (html.unescape would not)
]


@pytest.mark.parametrize("html, text", CASES)
def test_clean_text_is_the_html_text_with_whitespace_runs_made_one_space(html, text):
    assert hp.clean_text(html) == text


def test_clean_text_is_beautifulsoups_get_text_where_it_is_installed():
    bs4 = pytest.importorskip("bs4")  # not a dependency: the reference the authors used

    def reference(html: str) -> str:
        return re.sub(r"\s+", " ", bs4.BeautifulSoup(html, "html.parser").get_text())

    atoms = ["text", "  ", "\n", "\xa0", "&amp;", "&nbsp;", "&#39;", "&#150;", "&#129;", "&#0;", "&foo;", "&notit;",
             "&copy ", "AT&T", "&", "<!-- c -->", "<!--x", "<![CDATA[cd]]>", "<!DOCTYPE html>", "<?pi?>", "<", ">",
             "</br>", "<a href='x>y'>", "</ p>", "<!x>"]
    tags = ["p", "b", "br", "script", "style", "template", "rt", "rp", "div", "img", "pre", "span"]
    rng = random.Random(0)
    docs = [html for html, _ in CASES]
    for _ in range(2000):
        docs.append("".join(rng.choice(atoms) if rng.random() < 0.4 else
                            rng.choice(["<{}>", "</{}>", "<{}/>"]).format(rng.choice(tags))
                            for _ in range(rng.randint(1, 20))))
    assert [hp.clean_text(d) for d in docs] == [reference(d) for d in docs]


def articles(n: int = hp.NUM_ARTICLES) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [f"<p>article {i}</p>\n<p>its&nbsp; <b>end</b></p>" for i in range(n)],
                                       "hyperpartisan": [i % 2 == 1 for i in range(n)],
                                       "title": [f"t{i}" for i in range(n)]})


def test_the_splits_are_the_lists_articles_in_order():
    splits = hp.hyperpartisan_splits(articles())
    assert list(splits) == ["train", "validation", "test"]
    for name, indices in hp.HYPERPARTISAN_SPLITS.items():
        ds = splits[name]
        assert ds.column_names == ["text", "label", "article"]
        assert ds["article"] == indices
        assert ds["text"] == [f"article {i} its end" for i in indices]
        assert ds["label"] == [i % 2 for i in indices]
        assert ds.features["label"].names == ["false", "true"]


def test_a_source_that_is_not_the_645_articles_is_refused():
    with pytest.raises(ValueError, match="has 645 articles; this source has 644"):
        hp.hyperpartisan_splits(articles(644))
    with pytest.raises(ValueError, match="'hyperpartisan' is missing"):
        hp.hyperpartisan_splits(articles().remove_columns("hyperpartisan"))


def test_the_hub_is_read_from_its_parquet_conversion_by_folder(monkeypatch):
    calls = []

    def hub(path, **kwargs):
        calls.append((path, kwargs))
        if kwargs.get("revision") == "refs/convert/parquet" and kwargs.get("data_dir") == "byarticle":
            return articles()
        raise ValueError("BuilderConfig 'byarticle' not found. Available: ['default']")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert hp.load_hyperpartisan()["test"]["article"] == hp.HYPERPARTISAN_SPLITS["test"]
    assert calls == [("SemEvalWorkshop/hyperpartisan_news_detection",
                      {"split": "train", "data_dir": "byarticle", "revision": "refs/convert/parquet"})]


def test_local_sources_raw_or_split(tmp_path):
    raw = tmp_path / "raw"
    articles().save_to_disk(str(raw))
    assert hp.load_hyperpartisan(raw)["validation"]["article"] == hp.HYPERPARTISAN_SPLITS["validation"]
    jsonl = tmp_path / "a.jsonl"
    articles().to_json(str(jsonl))
    assert hp.load_hyperpartisan(jsonl)["train"]["text"][0] == "article 239 its end"
    done = tmp_path / "done"
    hp.hyperpartisan_splits(articles()).save_to_disk(str(done))
    assert hp.load_hyperpartisan(done)["test"]["article"] == hp.HYPERPARTISAN_SPLITS["test"]  # as it is
    other = tmp_path / "other"
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": ["a"]}) for s in ("train", "validation", "test")}
                         ).save_to_disk(str(other))
    with pytest.raises(ValueError, match="split 'train' has no column 'label'"):
        hp.load_hyperpartisan(other)


def test_the_cli_copy_is_read_by_the_classification_loader(tmp_path, capsys):
    raw = tmp_path / "articles.parquet"
    articles().to_parquet(str(raw))
    out = tmp_path / "hp"
    assert hp.main([str(out), "--source", str(raw)]) == 0
    printed = capsys.readouterr().out
    assert "train 516, validation 64, test 65" in printed and "'test&train': 51" in printed
    assert hp.main([str(out), "--source", str(raw)]) == 0  # a copy there is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["articles.parquet", "hp"]  # no temporary left
    docs = load_labelled_documents(path=str(out), tokenizer=write_book_tokenizer(tmp_path / "tok"),
                                   splits=("train", "validation", "test"))
    assert [docs[s].num_documents for s in ("train", "validation", "test")] == [516, 64, 65]
    assert docs["train"].label_names == ["false", "true"]
    assert docs["test"].dataset["label"] == [i % 2 for i in hp.HYPERPARTISAN_SPLITS["test"]]
    assert all(len(ids) > 0 for ids in docs["validation"].dataset["input_ids"])


@pytest.mark.parametrize("name, content, message", [
    ("missing.parquet", None, "does not exist"),
    ("bad.parquet", "garbage", "could not be read as parquet"),
    ("a.txt", "x", "give a save_to_disk folder or a .parquet"),
])
def test_the_cli_says_what_is_wrong_with_a_source_in_one_line(tmp_path, capsys, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    assert hp.main([str(tmp_path / "out"), "--source", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_cli_does_not_replace_a_folder_it_did_not_write(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert hp.main([str(tmp_path / "mine"), "--source", str(tmp_path / "x.parquet")]) == 2
    assert "is not a Hyperpartisan copy this module wrote; give a new folder" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    datasets.DatasetDict({"train": articles(3)}).save_to_disk(str(tmp_path / "other"))  # another save_to_disk
    assert hp.main([str(tmp_path / "other"), "--source", str(tmp_path / "x.parquet")]) == 2
    assert datasets.load_from_disk(str(tmp_path / "other"))["train"].num_rows == 3


def test_the_named_source_without_the_hub_says_how_to_supply_a_copy(monkeypatch):
    calls = []

    def offline(*args, **kwargs):
        calls.append(kwargs)
        raise ConnectionError("Couldn't reach 'SemEvalWorkshop/hyperpartisan_news_detection' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    how = r"could not be loaded from the hub .*python -m memoria_ds.data.hyperpartisan DIR --source"
    with pytest.raises(ValueError, match=how) as e:
        load_labelled_documents(path="hyperpartisan", tokenizer=None, splits=("train",))
    assert "\n" not in str(e.value)
    assert len(calls) == 1  # out of reach: the second way is not tried (each waits on the hub's retries)

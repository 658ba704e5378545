"""Deterministic FinQA-style demo data: a corpus of annual-report pages and QA items.

The demo needs a FinQA-like task that runs with no download: 40 invented companies, 12
annual reports each (2016-2027), 10 pages a report. Train, validation and test ask about
the reports of 2016-2022 (`REPORT_YEARS`); the test split reads only facts (company, year,
line item) that no other split reads, drawn from a random stream of its own: held-out items
of the same task, as FinQA's own test split is. Two shift evaluations ask other questions
(`shift/`, read by `agentrft demo-shift`): the figures of the later reports alone
(`TEST_YEARS`, 2023-2027: a temporal hold-out, as a job's newest traffic is) and 20
companies of their own (`NEW_COMPANY_TICKERS`, with a corpus of their own). Production
traffic asks about every year. The corpus declares the two filing periods
(`corpus/periods.json`): the tool server shows a question the reports of its year's period
alone, so the later reports do not distract the questions of the earlier ones (measured on
the shipped model: 16 validation items x 2 at seed 1234 scored 0.72 in the earlier reports
and 0.31 with all twelve years). Every page looks like a FinQA record
(a few sentences of pre-text, a small table in $ millions with the report year and the
prior year, post-text) and covers one topic: statements of operations, balance sheet,
cash flows, segments and so on. Each (ticker, report year, line item) sits on exactly one
page of that report, and the tables add up (gross profit = net revenue - cost of revenue,
and so on), so a question has one right answer that the agent finds by searching, listing
and reading pages and then calculating.

Items carry a FinQA `program` (`subtract(540, 480), divide(#0, 480)`), `exe_ans` (the
program executed by `execute_program`, rounded to 4 decimals; FinQA convention, so a
12.5% change has `exe_ans` 0.125) and `reference_answer`, the answer an analyst would
write: a plain number for amounts and ratios ("60", "513.3333", "0.5432"), and a
percentage with a "%" suffix for percent questions ("12.5%", whose value is
exe_ans x 100). `gold_pages` is a minimal set of pages that holds every number of the
program. Categories: single_lookup, change, percent_change, ratio and multi_year (averages,
totals and changes over 2-4 years that need pages of several reports).

Same seed, same bytes, on any machine: only seeded `random.Random` streams, no `hash()`
or set order, only + - * / on floats (no libm), fixed key order and `\\n` line endings.
The corpus depends on the seed alone; `drift=True` changes only the questions (a
multi_year/ratio-heavy mix and verbose wording) so validation can be tested against a
dataset that does not mirror production traffic.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from random import Random

from envs.finqa.tool_schemas import TOOL_SCHEMAS
from trainer.errors import DataError

# Invented single-word names, 3-5 uppercase letters: the tokenizer builder adds each as
# one token, so they must not collide with ordinary words.
TICKERS: list[str] = [
    "ACME", "BRIX", "CORVA", "DELQ", "ELMRA", "FYNX", "GLOQ", "HALVO", "IRIX", "JOVR",
    "KESTA", "LUMQ", "MORVA", "NEXQ", "OPTRA", "PYLO", "QUARV", "RIZO", "SOLVQ", "TRAXO",
    "ULTRQ", "VANTO", "WYLD", "XERVA", "YORQ", "ZENTA", "AMBRO", "BELQ", "CYRA", "DORVO",
    "EQUO", "FALQ", "GRIVA", "HOLQ", "INVRA", "JEXO", "KORA", "LYNQ", "MAVRO", "NOLVA",
]  # fmt: skip
REPORT_YEARS: list[int] = list(range(2016, 2023))
# Each report also shows the prior year, so the series start one year before the first report.
DATA_YEARS: list[int] = [REPORT_YEARS[0] - 1, *REPORT_YEARS]
# The later-years shift evaluation's years: every company's series continued from its own
# random stream after the corpus above, so the pages of 2016-2022 and the train and
# validation items keep their bytes. Its items read only figures of these years (a change
# question's earlier year is 2023 at the earliest). It was the third test split; the first
# (one topic of each company, 2015-2022) was read many times while the demo's settings were
# chosen and is retired, the second is the new-companies shift evaluation
# (test_readings.jsonl lists every reading).
TEST_YEARS: list[int] = list(range(2023, 2028))
# The second test split's companies (retired as a test split, kept as the `new_companies`
# shift evaluation): 20 companies of their own, reports of 2016-2022 drawn from their own
# random stream, in a corpus of their own beside the 40 (`new_companies_corpus`), so the
# main corpus and every other split keep their bytes.
NEW_COMPANY_TICKERS: list[str] = [
    "ARLO", "BEXA", "CALDO", "DRAVE", "ESKO", "FENRA", "GOVA", "HEXO", "ISKRA", "JALVO",
    "KIVA", "LORQ", "MERKA", "NUVO", "OXRA", "PELQ", "QIRA", "RUVA", "SKELD", "TOVRA",
]  # fmt: skip

CATEGORIES = ("single_lookup", "change", "percent_change", "ratio", "multi_year")
CATEGORY_MIX = {
    "single_lookup": 0.30,
    "change": 0.20,
    "percent_change": 0.20,
    "ratio": 0.15,
    "multi_year": 0.15,
}
DRIFT_CATEGORY_MIX = {
    "single_lookup": 0.05,
    "change": 0.05,
    "percent_change": 0.10,
    "ratio": 0.35,
    "multi_year": 0.45,
}

TRAFFIC_START = datetime(2025, 1, 1, tzinfo=UTC)
TRAFFIC_DAYS = 90

# One topic per page of every report: (title, line items in table order, intro sentences,
# reasons used in the narrative sentence). Line item names are unique across topics.
TOPICS: list[tuple[str, list[str], list[str], list[str]]] = [
    (
        "consolidated statements of operations",
        ["net revenue", "cost of revenue", "gross profit", "operating income"],
        ["The consolidated statements of operations of {t} for the years ended December 31, {y} and {p} are summarized below.",
         "This section presents {t}'s results of operations, from net revenue to operating income."],
        ["driven by pricing and volume", "reflecting demand in its core markets", "as product mix shifted"],
    ),
    (
        "operating expenses",
        ["research and development", "selling, general and administrative", "depreciation and amortization", "restructuring charges"],
        ["{t} reports its operating expenses by nature in the table below.",
         "Operating expenses of {t} include research, selling and administrative costs as well as depreciation."],
        ["as headcount changed", "reflecting cost discipline", "following investment in new products"],
    ),
    (
        "interest, other income and income taxes",
        ["interest expense", "interest income", "income before income taxes", "income tax expense", "net income"],
        ["The table below reconciles {t}'s operating income to net income, including interest and income taxes.",
         "{t}'s non-operating items and provision for income taxes for {y} and {p} are shown below."],
        ["reflecting the effective tax rate", "as borrowing costs moved", "with changes in operating results"],
    ),
    (
        "consolidated balance sheets - assets",
        ["cash and cash equivalents", "accounts receivable", "inventories", "property, plant and equipment", "goodwill", "total assets"],
        ["The consolidated balance sheets of {t} at December 31, {y} and {p} list the following assets.",
         "{t}'s assets, including cash, receivables, inventories and long-lived assets, are summarized below."],
        ["as the company invested in capacity", "reflecting working capital changes", "following acquisitions"],
    ),
    (
        "consolidated balance sheets - liabilities and equity",
        ["accounts payable", "accrued liabilities", "long-term debt", "total liabilities", "shareholders' equity"],
        ["The liabilities and shareholders' equity of {t} at December 31, {y} and {p} are shown below.",
         "{t}'s balance sheet funding, from payables and debt to shareholders' equity, is summarized below."],
        ["as the company refinanced its debt", "reflecting retained earnings", "with changes in supplier terms"],
    ),
    (
        "consolidated statements of cash flows",
        ["net cash from operating activities", "capital expenditures", "free cash flow", "net cash used in investing activities", "net cash used in financing activities"],
        ["{t}'s consolidated statements of cash flows are summarized below; free cash flow is operating cash flow less capital expenditures.",
         "The cash flows of {t} from operating, investing and financing activities in {y} and {p} are shown below."],
        ["reflecting working capital", "as capital spending changed", "with debt repayments"],
    ),
    (
        "segment information - net revenue by region",
        ["north america revenue", "europe revenue", "asia pacific revenue", "latin america revenue"],
        ["{t} reports net revenue in four geographic segments, shown below.",
         "The regional breakdown of {t}'s net revenue for {y} and {p} is presented below."],
        ["led by demand in its largest region", "reflecting currency movements", "as new markets grew"],
    ),
    (
        "shareholder returns",
        ["dividends paid", "share repurchases", "stock-based compensation", "treasury stock"],
        ["{t} returns capital to shareholders through dividends and share repurchases, summarized below.",
         "The table below shows {t}'s dividends, buybacks and equity compensation for {y} and {p}."],
        ["in line with its capital return policy", "as the board adjusted the program", "reflecting earnings"],
    ),
    (
        "employee benefit plans - pensions",
        ["pension benefit obligation", "fair value of pension plan assets", "net periodic pension cost", "employer pension contributions"],
        ["{t} sponsors defined benefit pension plans; their funded status and cost are summarized below.",
         "The obligations and plan assets of {t}'s pension plans at December 31, {y} and {p} are shown below."],
        ["reflecting discount rate changes", "as plan assets returned", "with changes in participants"],
    ),
    (
        "contractual obligations and commitments",
        ["operating lease obligations", "purchase obligations", "interest payments on debt", "other long-term obligations", "total contractual obligations"],
        ["{t}'s contractual obligations and commitments at December 31, {y} and {p} are summarized below.",
         "The table below lists {t}'s future payments under leases, purchase agreements and debt."],
        ["as new leases began", "reflecting supplier agreements", "with the debt maturity profile"],
    ),
]  # fmt: skip
LINE_ITEMS: list[str] = [item for _, items, _, _ in TOPICS for item in items]

# Ratio questions: (numerator, denominator, asked as a percentage?).
RATIO_PAIRS: list[tuple[str, str, bool]] = [
    ("gross profit", "net revenue", True),
    ("operating income", "net revenue", True),
    ("net income", "net revenue", True),
    ("research and development", "net revenue", True),
    ("north america revenue", "net revenue", True),
    ("europe revenue", "net revenue", True),
    ("asia pacific revenue", "net revenue", True),
    ("cash and cash equivalents", "total assets", True),
    ("long-term debt", "total assets", True),
    ("capital expenditures", "net cash from operating activities", True),
    ("dividends paid", "net income", True),
    ("income tax expense", "income before income taxes", True),
    ("fair value of pension plan assets", "pension benefit obligation", True),
    ("operating lease obligations", "total contractual obligations", True),
    ("total liabilities", "shareholders' equity", False),
    ("long-term debt", "shareholders' equity", False),
    ("net revenue", "total assets", False),
    ("accounts receivable", "accounts payable", False),
    ("free cash flow", "net income", False),
    ("net cash from operating activities", "net income", False),
    ("inventories", "cost of revenue", False),
]

TEMPLATES: dict[str, list[str]] = {
    "single_lookup": [
        "What was {t}'s {a} in {y}?",
        "How much {a} did {t} report for fiscal {y}, in $ millions?",
        "According to {t}'s {y} annual report, how much was {a}?",
        "In {y}, what did {t} report as {a}?",
    ],
    "change": [
        "By how much did {t}'s {a} change from {y0} to {y}?",
        "What was the change in {a} for {t} between {y0} and {y}, in $ millions?",
        "How much did {a} at {t} increase or decrease in {y} compared with {y0}?",
        "What is the difference between {t}'s {a} in {y} and in {y0}?",
    ],
    "percent_change": [
        "What was the percentage change in {t}'s {a} from {y0} to {y}?",
        "By what percent did {a} at {t} change in {y} relative to {y0}?",
        "What was {t}'s year-over-year growth rate in {a} for {y}?",
        "How did {t}'s {a} change in percentage terms between {y0} and {y}?",
    ],
    "ratio": [
        "What was the ratio of {a} to {b} for {t} in {y}?",
        "For {t} in {y}, what is {a} divided by {b}?",
        "In {y}, how many dollars of {a} did {t} have per dollar of {b}?",
    ],
    "ratio_percent": [
        "What percentage of {t}'s {b} did {a} represent in {y}?",
        "In {y}, what share of {b} was {a} at {t}, as a percentage?",
        "For {t}, {a} was what percent of {b} in {y}?",
    ],
    "average": [
        "What was {t}'s average {a} from {y0} to {y}?",
        "What was the average annual {a} of {t} for the years {y0}, {y1} and {y}?",
        "Averaged over {y0}-{y}, what was {t}'s {a}?",
    ],
    "total": [
        "What was {t}'s total {a} over the three years {y0} through {y}?",
        "What was the combined {a} of {t} in {y0}, {y1} and {y}?",
    ],
    "span_change": [
        "Over the {k} years from {y0} to {y}, how much did {t}'s {a} change?",
        "What was the cumulative change in {a} at {t} between {y0} and {y}, across {k} years?",
    ],
    "span_percent": [
        "What was the percentage change in {t}'s {a} over the {k}-year period from {y0} to {y}?",
        "By what percent did {t}'s {a} grow between {y0} and {y}, a span of {k} years?",
    ],
}

# Drifted questions carry this extra wording, so they are clearly longer than production's.
VERBOSE_PREFIXES = [
    "I am preparing a detailed briefing for our investment committee and need to double-check one figure from the filings.",
    "Our audit team is reconciling numbers across several years of annual reports and would like your help with the following.",
    "For an internal memo comparing peers in the sector, and making sure nothing is taken from press summaries,",
    "Please read the relevant annual report pages carefully, because the committee will rely on this number:",
]
VERBOSE_SUFFIXES = [
    "Please be precise, show the figure you used from each report, and give the final number clearly at the end.",
    "Take the amounts exactly as reported in the tables, in millions of dollars, without restated figures.",
    "This will go into a client-facing report, so accuracy matters more than speed here.",
]


def normalize_question(text: str) -> str:
    """Lowercase, punctuation dropped, whitespace collapsed: the key for train/eval disjointness."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


# --- FinQA programs ------------------------------------------------------------------

_STEP = r"([a-z_]+)\(([^()]*)\)"
_PROGRAM = re.compile(rf"\s*{_STEP}(\s*,\s*{_STEP})*\s*")


def _argument(arg: str, results: list[float], program: str) -> float:
    arg = arg.strip()
    if arg.startswith("#"):
        index = int(arg[1:]) if arg[1:].isdigit() else -1
        if not 0 <= index < len(results):
            raise DataError(f"program {program!r}: {arg} refers to no earlier step")
        return results[index]
    if arg.startswith("const_"):
        # FinQA writes -1 as const_m1.
        arg = arg[len("const_") :].replace("m", "-", 1)
    scale = 1.0
    if arg.endswith("%"):
        arg, scale = arg[:-1], 0.01
    try:
        return float(arg) * scale
    except ValueError:
        raise DataError(f"program {program!r}: {arg!r} is not a number, #k or const_N") from None


def execute_program(program: str) -> float:
    """Run a FinQA program such as 'subtract(540, 480), divide(#0, 480)' and return the
    last step's value. A program with no step (a single lookup) is just its number.
    `greater` gives 1.0 or 0.0 (FinQA's yes/no)."""
    if "(" not in program:
        return _argument(program, [], program)
    if not _PROGRAM.fullmatch(program):
        raise DataError(f"program {program!r}: expected steps like 'op(a, b), op(#0, c)'")
    results: list[float] = []
    for op, args_text in re.findall(_STEP, program):
        if op not in ("add", "subtract", "multiply", "divide", "exp", "greater"):
            raise DataError(
                f"program {program!r}: unknown op {op!r} (add, subtract, multiply, divide, exp, greater)"
            )
        args = args_text.split(",")
        if len(args) != 2:
            raise DataError(f"program {program!r}: {op} takes two arguments, got {args_text!r}")
        a, b = (_argument(arg, results, program) for arg in args)
        match op:
            case "add":
                results.append(a + b)
            case "subtract":
                results.append(a - b)
            case "multiply":
                results.append(a * b)
            case "divide":
                if b == 0:
                    raise DataError(f"program {program!r}: division by zero")
                results.append(a / b)
            case "exp":
                results.append(a**b)
            case "greater":
                results.append(1.0 if a > b else 0.0)
    return results[-1]


def _trim(number_text: str) -> str:
    if "." in number_text:
        number_text = number_text.rstrip("0").rstrip(".")
    return "0" if number_text == "-0" else number_text


def format_answer(exe_ans: float, *, percent: bool) -> str:
    """The reference answer: '12.5%' (exe_ans 0.125) for percent questions, else '60' or '0.5432'."""
    if percent:
        return _trim(f"{exe_ans * 100:.2f}") + "%"
    return _trim(f"{exe_ans:.4f}")


# --- pages ---------------------------------------------------------------------------


def render_page(pre_text: list[str], table: list[list[str]], post_text: list[str]) -> str:
    """A FinQA record as one page: pre-text lines, the table with ' | ' between cells, post-text."""
    blocks = [
        "\n".join(pre_text),
        "\n".join(" | ".join(row) for row in table),
        "\n".join(post_text),
    ]
    return "\n\n".join(block for block in blocks if block) + "\n"


def _show(tenths: int, decimal: bool) -> str:
    return f"{tenths // 10}.{tenths % 10}" if decimal else str(tenths // 10)


class _Company:
    """One company's line items over its years, in tenths of $ millions so that totals
    are exact. Leaf items are a share of a parent item that drifts within a range; totals
    are sums of rounded items, so every table adds up."""

    def __init__(self, rng: Random):
        self.rng = rng
        self.years: list[int] = list(DATA_YEARS)
        self.tenths: dict[str, list[int]] = {}
        self.decimal: dict[str, bool] = {}

    def continue_to(self, rng: Random, years: list[int]) -> None:
        """Continue every series through `years` from `rng`: the values already drawn stay,
        roots go on with their walk and shares drift on from their last year's share
        (`_build_company` replays its steps, each extending its item)."""
        self.rng = rng
        self.years = [*self.years, *years]
        _build_company(rng, self)

    def _round(self, name: str, values: list[float], decimal: bool | None = None) -> None:
        # Small amounts keep one decimal, large ones are whole millions (as reports print them).
        # A series being continued keeps its print format and its earlier values.
        if name not in self.tenths:
            self.decimal[name] = values[0] < 100 if decimal is None else decimal
        if self.decimal[name]:
            rounded = [max(1, int(v * 10 + 0.5)) for v in values]
        else:
            rounded = [max(1, int(v + 0.5)) * 10 for v in values]
        self.tenths[name] = [*self.tenths.get(name, []), *rounded]

    def root(self, name: str, base: float) -> None:
        drawn = self.tenths.get(name, [])
        values = [drawn[-1] / 10] if drawn else [base]  # a continued walk starts from its last year
        while len(values) < len(self.years) - len(drawn) + (1 if drawn else 0):
            values.append(values[-1] * (1 + self.rng.uniform(-0.06, 0.16)))
        self._round(name, values[1:] if drawn else values)

    def share(
        self, name: str, parent: str, lo: float, hi: float, decimal: bool | None = None
    ) -> None:
        drawn = self.tenths.get(name, [])
        parents = self.tenths[parent]
        values = []
        if drawn:
            share = min(hi, max(lo, drawn[-1] / parents[len(drawn) - 1]))
            for tenths in parents[len(drawn):]:
                share = min(hi, max(lo, share + self.rng.uniform(-0.15, 0.15) * (hi - lo)))
                values.append(tenths / 10 * share)
        else:
            share = self.rng.uniform(lo, hi)
            for tenths in parents:
                values.append(tenths / 10 * share)
                share = min(hi, max(lo, share + self.rng.uniform(-0.15, 0.15) * (hi - lo)))
        self._round(name, values, decimal)

    def total(self, name: str, plus: list[str], minus: tuple[str, ...] = ()) -> None:
        self.decimal[name] = any(self.decimal[part] for part in [*plus, *minus])
        self.tenths[name] = [
            sum(self.tenths[p][i] for p in plus) - sum(self.tenths[m][i] for m in minus)
            for i in range(len(self.years))
        ]

    def value(self, item: str, year: int) -> str:
        return _show(self.tenths[item][self.years.index(year)], self.decimal[item])


def _build_company(rng: Random, company: _Company | None = None) -> _Company:
    """A company's line items over its years, or (given `company`) its series continued to
    `company.years`: the same steps, each extending its item."""
    c = company or _Company(rng)
    # Ranges are chosen so that every total stays positive (operating income >= 7% of revenue).
    c.root("net revenue", rng.choice([200, 500, 1000, 2500, 6000]) * rng.uniform(0.7, 1.4))
    c.share("cost of revenue", "net revenue", 0.45, 0.60, decimal=c.decimal["net revenue"])
    c.total("gross profit", ["net revenue"], ("cost of revenue",))
    c.share("research and development", "net revenue", 0.03, 0.12)
    c.share("selling, general and administrative", "net revenue", 0.08, 0.15)
    c.share("depreciation and amortization", "net revenue", 0.02, 0.05)
    c.share("restructuring charges", "net revenue", 0.002, 0.01)
    opex = ("research and development", "selling, general and administrative",
            "depreciation and amortization", "restructuring charges")  # fmt: skip
    c.total("operating income", ["gross profit"], opex)
    c.share("interest expense", "net revenue", 0.005, 0.03)
    c.share("interest income", "net revenue", 0.001, 0.01)
    c.total(
        "income before income taxes", ["operating income", "interest income"], ("interest expense",)
    )
    c.share("income tax expense", "income before income taxes", 0.15, 0.30)
    c.total("net income", ["income before income taxes"], ("income tax expense",))

    c.share("total assets", "net revenue", 0.9, 1.8, decimal=False)
    for name, lo, hi in [("cash and cash equivalents", 0.05, 0.20), ("accounts receivable", 0.08, 0.18),
                         ("inventories", 0.05, 0.15), ("property, plant and equipment", 0.20, 0.35),
                         ("goodwill", 0.05, 0.20), ("accounts payable", 0.05, 0.12),
                         ("accrued liabilities", 0.04, 0.10), ("long-term debt", 0.10, 0.30)]:  # fmt: skip
        c.share(name, "total assets", lo, hi)
    c.share("other liabilities", "total assets", 0.05, 0.15, decimal=c.decimal["long-term debt"])
    c.total(
        "total liabilities",
        ["accounts payable", "accrued liabilities", "long-term debt", "other liabilities"],
    )
    c.total("shareholders' equity", ["total assets"], ("total liabilities",))

    c.share("net cash from operating activities", "net revenue", 0.10, 0.22)
    c.share(
        "capital expenditures",
        "net revenue",
        0.03,
        0.08,
        decimal=c.decimal["net cash from operating activities"],
    )
    c.total("free cash flow", ["net cash from operating activities"], ("capital expenditures",))
    c.share("acquisitions", "net revenue", 0.005, 0.04)
    c.total("net cash used in investing activities", ["capital expenditures", "acquisitions"])
    c.share("net cash used in financing activities", "net revenue", 0.02, 0.10)

    decimal = c.decimal["net revenue"]
    c.share("north america revenue", "net revenue", 0.35, 0.50, decimal=decimal)
    c.share("europe revenue", "net revenue", 0.18, 0.28, decimal=decimal)
    c.share("asia pacific revenue", "net revenue", 0.10, 0.20, decimal=decimal)
    c.total(
        "latin america revenue",
        ["net revenue"],
        ("north america revenue", "europe revenue", "asia pacific revenue"),
    )

    c.share("dividends paid", "net income", 0.20, 0.50)
    c.share("share repurchases", "net income", 0.10, 0.60)
    c.share("stock-based compensation", "net revenue", 0.01, 0.04)
    c.share("treasury stock", "total assets", 0.02, 0.10)

    c.share("pension benefit obligation", "net revenue", 0.05, 0.20)
    c.share("fair value of pension plan assets", "pension benefit obligation", 0.70, 1.05)
    c.share("net periodic pension cost", "pension benefit obligation", 0.03, 0.08)
    c.share("employer pension contributions", "pension benefit obligation", 0.02, 0.06)

    for name, lo, hi in [("operating lease obligations", 0.02, 0.08), ("purchase obligations", 0.03, 0.12),
                         ("interest payments on debt", 0.01, 0.05), ("other long-term obligations", 0.01, 0.04)]:  # fmt: skip
        c.share(name, "net revenue", lo, hi)
    c.total("total contractual obligations",
            ["operating lease obligations", "purchase obligations", "interest payments on debt", "other long-term obligations"])  # fmt: skip
    return c


class _Corpus:
    """Every company's reports: page texts, and which page of which report holds an item."""

    def __init__(self, seed: int):
        rng = Random(f"{seed}/corpus")
        self.companies: dict[str, _Company] = {}
        self.pages: dict[str, str] = {}  # corpus-relative path -> text
        self.page_of: dict[tuple[str, int, str], str] = {}
        for ticker in TICKERS:
            self.companies[ticker] = _build_company(rng)
            self._reports(rng, ticker, REPORT_YEARS)
        test_rng = Random(f"{seed}/corpus/test-years")
        for ticker in TICKERS:
            self.companies[ticker].continue_to(test_rng, TEST_YEARS)
            self._reports(test_rng, ticker, TEST_YEARS)

    def add_new_companies(self, seed: int) -> dict[str, str]:
        """The `NEW_COMPANY_TICKERS`' reports of `REPORT_YEARS` (added to this corpus's
        companies); returns their pages, which the main corpus does not hold."""
        before = set(self.pages)
        rng = Random(f"{seed}/corpus/test-companies")
        for ticker in NEW_COMPANY_TICKERS:
            self.companies[ticker] = _build_company(rng)
            self._reports(rng, ticker, REPORT_YEARS)
        return {path: text for path, text in self.pages.items() if path not in before}

    def _reports(self, rng: Random, ticker: str, years: list[int]) -> None:
        company = self.companies[ticker]
        for year in years:
            # Topics land on different pages in each report, so the agent has to search.
            order = list(range(len(TOPICS)))
            rng.shuffle(order)
            for page_number, topic_index in enumerate(order, start=1):
                path = f"reports/{ticker}/{year}/page_{page_number}.txt"
                self.pages[path] = self._page(rng, company, ticker, year, TOPICS[topic_index])
                for item in TOPICS[topic_index][1]:
                    self.page_of[(ticker, year, item)] = path

    @staticmethod
    def _page(rng: Random, c: _Company, ticker: str, year: int, topic: tuple) -> str:
        title, items, intros, reasons = topic
        prior = year - 1
        first = items[0]
        now, before = (
            c.tenths[first][c.years.index(year)],
            c.tenths[first][c.years.index(prior)],
        )
        direction = (
            "increased" if now > before else "decreased" if now < before else "was unchanged"
        )
        pre_text = [
            f"{ticker} {year} annual report - {title}",
            rng.choice(intros).format(t=ticker, y=year, p=prior),
            f"In {year}, {first} {direction} compared with {prior}, {rng.choice(reasons)}.",
        ]
        table = [["(in $ millions)", str(year), str(prior)]]
        table += [[item, c.value(item, year), c.value(item, prior)] for item in items]
        post_text = [
            f"All amounts are in millions of US dollars; {prior} amounts are shown for comparison."
        ]
        return render_page(pre_text, table, post_text)

    def gold_pages(self, ticker: str, needs: list[tuple[str, int]]) -> list[str]:
        """A minimal set of pages holding every (item, year): the report of a year also shows
        the prior year, so take reports from the latest year needed downwards."""
        pages: list[str] = []
        covered: list[tuple[str, int]] = []
        for item, year in sorted(needs, key=lambda need: -need[1]):
            if (item, year) in covered:
                continue
            report = year if (ticker, year, item) in self.page_of else year + 1
            page = self.page_of[(ticker, report, item)]
            if page not in pages:
                pages.append(page)
            covered += [(item, report), (item, report - 1)]
        return pages


# --- questions -----------------------------------------------------------------------


def _draw_question(
    rng: Random, corpus: _Corpus, category: str, years: list[int] = REPORT_YEARS, fresh: bool = False,
    tickers: list[str] = TICKERS,
) -> tuple[dict, set[tuple[str, int, str]]]:
    """One question of a category about one of `tickers` in one of `years` (its text,
    program and the pages it needs) and the facts (ticker, year, line item) it reads.
    `fresh`: every figure it reads is of `years` (a change question's earlier year too)."""
    t = rng.choice(tickers)
    c = corpus.companies[t]
    a = "" if category == "ratio" else rng.choice(LINE_ITEMS)
    percent = False
    fields: dict = {"t": t, "a": a}
    match category:
        case "single_lookup":
            y = rng.choice(years)
            template = rng.choice(TEMPLATES["single_lookup"])
            program, needs = c.value(a, y), [(a, y)]
        case "change" | "percent_change":
            y = rng.choice(years[1:] if fresh else years)
            fields["y0"] = y - 1
            new, old = c.value(a, y), c.value(a, y - 1)
            template = rng.choice(TEMPLATES[category])
            program = f"subtract({new}, {old})"
            if category == "percent_change":
                program += f", divide(#0, {old})"
                percent = True
            needs = [(a, y), (a, y - 1)]
        case "ratio":
            y = rng.choice(years)
            a, b, percent = rng.choice(RATIO_PAIRS)
            fields.update(a=a, b=b)
            template = rng.choice(TEMPLATES["ratio_percent" if percent else "ratio"])
            program = f"divide({c.value(a, y)}, {c.value(b, y)})"
            needs = [(a, y), (b, y)]
        case "multi_year":
            kind = rng.choice(["average", "total", "span_change", "span_percent"])
            k = 2 if kind in ("average", "total") else rng.choice([2, 3, 4])
            y = rng.choice(years[k:])
            fields.update(y0=y - k, y1=y - 1, k=k)
            template = rng.choice(TEMPLATES[kind])
            if kind in ("average", "total"):
                v0, v1, v2 = (c.value(a, year) for year in (y - 2, y - 1, y))
                program = f"add({v0}, {v1}), add(#0, {v2})"
                if kind == "average":
                    program += ", divide(#1, const_3)"
                needs = [(a, y - 2), (a, y - 1), (a, y)]
            else:
                new, old = c.value(a, y), c.value(a, y - k)
                program = f"subtract({new}, {old})"
                if kind == "span_percent":
                    program += f", divide(#0, {old})"
                    percent = True
                needs = [(a, y), (a, y - k)]
        case _:
            raise ValueError(f"unknown category {category!r}")
    question = template.format(y=y, **fields)
    exe_ans = round(execute_program(program), 4)
    qa = {
        "question": question,
        "reference_answer": format_answer(exe_ans, percent=percent),
        "exe_ans": exe_ans,
        "program": program,
        "category": category,
        "ticker": t,
        "year": y,
        "gold_pages": corpus.gold_pages(t, needs),
    }
    return qa, {(t, year, item) for item, year in needs}


def _category_plan(rng: Random, n: int, mix: dict[str, float]) -> list[str]:
    """Exactly n categories in the mix's proportions (largest remainder), shuffled."""
    exact = {cat: n * mix[cat] for cat in CATEGORIES}
    counts = {cat: int(exact[cat]) for cat in CATEGORIES}
    by_remainder = sorted(
        CATEGORIES, key=lambda cat: (-(exact[cat] - counts[cat]), CATEGORIES.index(cat))
    )
    for cat in by_remainder[: n - sum(counts.values())]:
        counts[cat] += 1
    plan = [cat for cat in CATEGORIES for _ in range(counts[cat])]
    rng.shuffle(plan)
    return plan


def assign_fact_units(seed: int) -> dict[tuple[str, int], str]:
    """Every (ticker, topic) pair, the unit of underlying facts, assigned to one split:
    the line items of a topic sit on one page of each report, so a split owns all the
    values (every year) of its units, and no company-year-line-item fact answers items in
    two splits. Each of the 40 `TICKERS` gives one topic to validation, eight to train and
    one to the retired first test split ("retired": no split reads it any more), all of
    them over 2015-2022; the test split owns every figure of `TEST_YEARS` instead."""
    owner: dict[tuple[str, int], str] = {}
    for ticker in TICKERS:
        topics = list(range(len(TOPICS)))
        Random(f"{seed}/fact-units/{ticker}").shuffle(topics)
        for index, topic in enumerate(topics):
            owner[(ticker, topic)] = "retired" if index == 0 else "validation" if index == 1 else "train"
    return owner


TOPIC_OF: dict[str, int] = {item: index for index, (_, items, _, _) in enumerate(TOPICS) for item in items}


def _split_items(
    rng: Random,
    corpus: _Corpus,
    n: int,
    drift: bool,
    seen: dict[str, None],
    units: set[tuple[str, int]] | None = None,
    years: list[int] = REPORT_YEARS,
    fresh: bool = False,
    tickers: list[str] = TICKERS,
    avoid: set[tuple[str, int, str]] | None = None,
    read: set[tuple[str, int, str]] | None = None,
) -> list[dict]:
    """`n` items in the category mix about `tickers` in `years` (`fresh`: reading figures of
    those years alone), unique by normalised question across all splits, reading only facts
    of the (ticker, topic) `units` when given and none of the facts in `avoid`. The facts
    the items read are added to `read`."""
    items = []
    for category in _category_plan(rng, n, DRIFT_CATEGORY_MIX if drift else CATEGORY_MIX):
        for _ in range(20_000):
            qa, facts = _draw_question(rng, corpus, category, years, fresh, tickers)
            if units is not None and not {(t, TOPIC_OF[item]) for t, _, item in facts} <= units:
                continue
            if avoid is not None and facts & avoid:
                continue
            if drift:
                qa["question"] = (
                    f"{rng.choice(VERBOSE_PREFIXES)} {qa['question']} {rng.choice(VERBOSE_SUFFIXES)}"
                )
            key = normalize_question(qa["question"])
            if key not in seen:
                seen[key] = None
                items.append(qa)
                if read is not None:
                    read |= facts
                break
        else:
            raise ValueError(
                f"no new unique {category} question after 20000 draws: ask for fewer items"
            )
    return items


def retired_first_test_split(seed: int = 0, n_train: int = 2000, n_validation: int = 250,
                             n_test: int = 250) -> list[dict]:
    """The first test split's rows (retired: read 17 times while the demo was tuned), drawn
    again as it was drawn then: after train and validation, from the retired units. No job
    reads it as a test split any more; the test suite's micro world takes a few of its items,
    whose pages (2015-2022) are the corpus's still."""
    corpus = _Corpus(seed)
    owner = assign_fact_units(seed)
    rng = Random(f"{seed}/questions/production")
    seen: dict[str, None] = {}
    for name, size in (("train", n_train), ("validation", n_validation)):
        _split_items(rng, corpus, size, False, seen, {u for u, o in owner.items() if o == name})
    items = _split_items(rng, corpus, n_test, False, seen, {u for u, o in owner.items() if o == "retired"})
    return [_row(f"test-{i:05d}", qa) for i, qa in enumerate(items)]


def _row(item_id: str, qa: dict) -> dict:
    return {
        "id": item_id,
        "messages": [{"role": "user", "content": qa["question"]}],
        "tools": TOOL_SCHEMAS,
        **qa,
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object a line, UTF-8, '\\n' endings, keys in the order they were built."""
    path.write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows),
        encoding="utf-8",
        newline="\n",
    )


def generate_dataset(
    out_dir: Path,
    *,
    seed: int = 0,
    drift: bool = False,
    n_train: int = 2000,
    n_validation: int = 250,
    n_test: int = 250,
    n_traffic: int = 4000,
) -> dict:
    """Write the corpus, train.jsonl, validation.jsonl, test.jsonl, the shift evaluations
    (`shift/later_years/items.jsonl`, `shift/new_companies/items.jsonl` with its corpus) and
    production_traffic.jsonl under out_dir and return the counts. Files are overwritten;
    nothing else in out_dir is touched.

    Train, validation and test are disjoint by id, by normalised question and by underlying
    fact: each (ticker, topic) unit of 2015-2022 belongs to train or validation
    (`assign_fact_units`), and the test split, drawn from its own random stream over the same
    companies and report years, reads only facts (ticker, year, line item) that no other
    split reads, the retired first test split included. The shift evaluations ask another
    question than the test split: the later reports (2023-2027) of the same companies, and
    20 companies of their own. Production traffic is what users ask: drawn from every
    company and every report year, unique by question against the splits."""
    out_dir = Path(out_dir)
    corpus = _Corpus(seed)
    _write_corpus(out_dir / "corpus", corpus.pages)
    # Two filing periods: a question sees the reports of its year's period alone (the tool
    # server reads this file), so the later reports never distract train and validation
    # items and the earlier ones never distract the later-years split's.
    periods = {"periods": [[REPORT_YEARS[0], REPORT_YEARS[-1]], [TEST_YEARS[0], TEST_YEARS[-1]]]}
    (out_dir / "corpus" / "periods.json").write_text(json.dumps(periods) + "\n", encoding="utf-8", newline="\n")

    owner = assign_fact_units(seed)
    rng = Random(f"{seed}/questions/{'drift' if drift else 'production'}")
    seen: dict[str, None] = {}  # insertion-ordered, never iterated: only membership
    read: set[tuple[str, int, str]] = set()  # the facts every split reads
    splits = {
        name: _split_items(rng, corpus, size, drift, seen, {u for u, o in owner.items() if o == name}, read=read)
        for name, size in (("train", n_train), ("validation", n_validation))
    }
    # The retired first test split and the new-companies split were each drawn from here.
    after_validation = rng.getstate()
    retired = Random()
    retired.setstate(after_validation)
    _split_items(retired, corpus, n_test, drift, dict(seen), {u for u, o in owner.items() if o == "retired"},
                 read=read)
    new_pages = corpus.add_new_companies(seed)
    new_companies = Random()
    new_companies.setstate(after_validation)
    shift = {"new_companies": _split_items(new_companies, corpus, n_test, drift, dict(seen),
                                           tickers=NEW_COMPANY_TICKERS, read=read)}
    shift["later_years"] = _split_items(rng, corpus, n_test, drift, seen, years=TEST_YEARS, fresh=True, read=read)
    traffic = _split_items(rng, corpus, n_traffic, drift, seen, years=REPORT_YEARS + TEST_YEARS)
    for items in shift.values():
        seen.update((normalize_question(qa["question"]), None) for qa in items)
    held_out = Random(f"{seed}/questions/{'drift' if drift else 'production'}/held-out")
    splits["test"] = _split_items(held_out, corpus, n_test, drift, seen, avoid=set(read))

    # Production traffic arrives over 90 days; ids follow arrival order.
    seconds = [rng.randrange(TRAFFIC_DAYS * 86400) for _ in traffic]
    arrivals = sorted(range(len(traffic)), key=lambda i: (seconds[i], i))
    traffic_rows = []
    for n, i in enumerate(arrivals):
        row = _row(f"traffic-{n:05d}", traffic[i])
        row["timestamp"] = (TRAFFIC_START + timedelta(seconds=seconds[i])).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        traffic_rows.append(row)

    for name, items in splits.items():
        prefix = "heldout" if name == "test" else name
        write_jsonl(out_dir / f"{name}.jsonl", [_row(f"{prefix}-{i:05d}", qa) for i, qa in enumerate(items)])
    for name, items in shift.items():
        (out_dir / "shift" / name).mkdir(parents=True, exist_ok=True)
        # ids as when each was the test split: its readings in the ledger stay its own
        write_jsonl(out_dir / "shift" / name / "items.jsonl", [_row(f"test-{i:05d}", qa) for i, qa in enumerate(items)])
    # The new companies' reports beside the 40 companies' of the same years, as they were served
    # when that split was the test split (no later reports, no filing periods).
    earlier = {path: text for path, text in corpus.pages.items()
               if path not in new_pages and int(path.split("/")[2]) in REPORT_YEARS}
    _write_corpus(out_dir / "shift" / "new_companies" / "corpus", {**earlier, **new_pages})
    write_jsonl(out_dir / "production_traffic.jsonl", traffic_rows)
    return {"pages": len(corpus.pages) - len(new_pages), **{name: len(items) for name, items in splits.items()},
            **{f"shift/{name}": len(items) for name, items in shift.items()},
            "production_traffic": len(traffic_rows)}


def _write_corpus(root: Path, pages: dict[str, str]) -> None:
    for path, text in pages.items():
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8", newline="\n")

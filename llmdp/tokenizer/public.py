"""A *public* corpus and the demo tokenizer trained on it.

A tokenizer trained on private text leaks it (its vocabulary is a function of the data:
a merge for a rare surname says that surname is in the corpus; the DP-fy guide, §5.5).
The demo therefore ships a tokenizer trained only on text written here, by a generator
that shares no code path, template or seed with the private corpus generator
(``llmdp.data.synthetic``): encyclopedic sentences about conditions, drugs and anatomy,
and general English prose. It reuses only the *public vocabularies* of condition and drug
names, which are public knowledge, not records. It never writes a person's name, a record
number, a date of birth or a note header.

Regenerate the shipped artifact with::

    python -m llmdp.tokenizer.public tokenizers/demo-public
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

from faker import Faker

from llmdp._fs import folder_mode
from llmdp.data.synthetic import CONDITIONS, MEDICATIONS

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<unk>")
DEFAULT_NUM_LINES = 30_000
DEFAULT_VOCAB_SIZE = 2048

_ORGANS = {
    "heart": ("chest", "pumping blood through the circulatory system"),
    "lungs": ("chest", "exchanging oxygen and carbon dioxide"),
    "liver": ("upper right abdomen", "metabolism, bile production and detoxification"),
    "kidneys": ("back of the abdomen", "filtering blood and producing urine"),
    "pancreas": ("upper abdomen", "producing insulin and digestive enzymes"),
    "thyroid gland": ("front of the neck", "regulating metabolism through hormones"),
    "brain": ("skull", "controlling thought, movement and sensation"),
    "stomach": ("upper abdomen", "breaking down food with acid and enzymes"),
    "colon": ("abdomen", "absorbing water and forming stool"),
    "skin": ("surface of the body", "protecting the body from injury and infection"),
    "spinal cord": ("vertebral canal", "carrying signals between the brain and the body"),
    "bone marrow": ("center of large bones", "producing blood cells"),
    "gallbladder": ("beneath the liver", "storing bile"),
    "prostate": ("pelvis", "producing seminal fluid"),
    "joints": ("limbs and spine", "allowing movement between bones"),
    "blood vessels": ("whole body", "carrying blood to and from the tissues"),
}
_SYMPTOMS = (
    "fatigue", "fever", "pain", "swelling", "shortness of breath", "cough", "headache",
    "dizziness", "nausea", "weight loss", "weight gain", "itching", "stiffness", "weakness",
    "confusion", "palpitations", "thirst", "frequent urination", "chest tightness", "rash",
    "numbness", "tremor", "poor sleep", "low mood",
)
_DRUG_CLASSES = {
    "metformin": "biguanides", "lisinopril": "ACE inhibitors", "losartan": "angiotensin receptor blockers",
    "amlodipine": "calcium channel blockers", "atorvastatin": "statins", "rosuvastatin": "statins",
    "metoprolol succinate": "beta blockers", "metoprolol tartrate": "beta blockers",
    "carvedilol": "beta blockers", "furosemide": "loop diuretics",
    "hydrochlorothiazide": "thiazide diuretics", "apixaban": "direct oral anticoagulants",
    "warfarin": "vitamin K antagonists", "sertraline": "selective serotonin reuptake inhibitors",
    "escitalopram": "selective serotonin reuptake inhibitors", "omeprazole": "proton pump inhibitors",
    "pantoprazole": "proton pump inhibitors", "albuterol": "short-acting beta agonists",
    "prednisone": "corticosteroids", "ceftriaxone": "cephalosporin antibiotics",
    "azithromycin": "macrolide antibiotics", "gabapentin": "anticonvulsants",
    "levetiracetam": "anticonvulsants", "oxycodone": "opioid analgesics",
    "allopurinol": "xanthine oxidase inhibitors", "levothyroxine": "thyroid hormones",
}
_ENCYCLOPEDIC = (
    "{Cond} is a condition that mainly affects the {organ}.",
    "Common symptoms of {cond} include {s1}, {s2} and {s3}.",
    "The diagnosis of {cond} is usually based on the history, a physical examination and laboratory tests.",
    "Risk factors for {cond} include age, smoking, obesity and a family history of the disease.",
    "Treatment of {cond} may include lifestyle changes, medication and, in some cases, surgery.",
    "In many countries, {cond} is one of the most common reasons for visiting a doctor.",
    "{Drug} is a medication used in the treatment of {cond}.",
    "{Drug} belongs to a group of medicines known as {klass}.",
    "Typical adult doses of {drug} range from {dose_lo} to {dose_hi}, taken {freq}.",
    "Side effects of {drug} can include {s1} and {s2}; most are mild and go away with time.",
    "{Drug} should not be combined with {drug2} without advice from a pharmacist.",
    "The {organ} is located in the {region} and is responsible for {function}.",
    "Diseases of the {organ} include {cond} and {cond2}.",
    "Researchers estimate that {pct} percent of adults over {age} have {cond}.",
    "A study published in {year} found that regular exercise lowers the risk of {cond}.",
    "Guidelines recommend screening for {cond} every {n} years in people at higher risk.",
    "Blood pressure is measured in millimetres of mercury, for example {sbp}/{dbp} mmHg.",
    "A normal resting heart rate for adults is between 60 and 100 beats per minute.",
    "Body temperature is often reported in degrees Celsius; {temp} C is within the normal range.",
    "Hospitals in {city} treated more cases of {cond} during the winter of {year}.",
)
_PROSE = (
    "The {adj} {noun} in {city} was built in {year} and restored {n} years later.",
    "{Company} announced a new {product} on {weekday}, according to a press release.",
    "Visitors to {country} often travel by train between the larger cities.",
    "The weather in {city} was {weather} for most of the week.",
    "On {weekday} the library opened a new reading room for children and students.",
    "Local farmers said the {season} harvest was better than expected.",
    "The committee met for {n} hours and agreed to publish its findings next {month}.",
    "She walked to the station, bought a ticket and waited for the {time} train.",
    "He said the project would cost about {money} and take {n} months to finish.",
    "Questions about the schedule can be sent to the office before {month} {day}.",
)


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class _Pools:
    """Faker values drawn once (faker is slow per call); lines then pick from them with rng."""

    def __init__(self, fake: Faker, size: int = 400):
        self.cities = [fake.city() for _ in range(size)]
        self.companies = [fake.company() for _ in range(size // 2)]
        self.countries = sorted({fake.country() for _ in range(size)})
        self.phones = [fake.phone_number() for _ in range(size // 2)]
        self.addresses = [fake.address().replace("\n", ", ") for _ in range(size // 2)]

    weekdays = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
    months = ("January", "February", "March", "April", "May", "June", "July", "August",
              "September", "October", "November", "December")


def _encyclopedic_line(rng: random.Random, pools: _Pools) -> str:
    tmpl = rng.choice(_ENCYCLOPEDIC)
    drug, doses, freqs = rng.choice(MEDICATIONS)
    drug2 = rng.choice(MEDICATIONS)[0]
    organ = rng.choice(tuple(_ORGANS))
    region, function = _ORGANS[organ]
    cond, cond2 = rng.sample(CONDITIONS, 2)
    s1, s2, s3 = rng.sample(_SYMPTOMS, 3)
    return tmpl.format(
        cond=cond, Cond=_cap(cond), cond2=cond2, drug=drug, Drug=_cap(drug), drug2=drug2,
        klass=_DRUG_CLASSES.get(drug, "prescription medicines"), dose_lo=doses[0],
        dose_hi=doses[-1], freq=rng.choice(("once a day", "twice a day", "as needed", "weekly")),
        organ=organ, region=region, function=function, s1=s1, s2=s2, s3=s3,
        pct=rng.randint(2, 40), age=rng.choice((40, 50, 60, 65, 70)), year=rng.randint(1950, 2024),
        n=rng.randint(1, 10), sbp=rng.randint(100, 160), dbp=rng.randint(60, 100),
        temp=round(rng.uniform(36.1, 37.4), 1), city=rng.choice(pools.cities),
    )


_ABBREVIATIONS = (
    ("PO", "by mouth"), ("BID", "twice a day"), ("TID", "three times a day"),
    ("PRN", "as needed"), ("q6h", "every six hours"), ("subcut", "under the skin"),
    ("IV", "intravenous"), ("IM", "intramuscular"), ("SL", "under the tongue"),
    ("NKDA", "no known drug allergies"), ("HPI", "history of present illness"),
    ("PMH", "past medical history"), ("RTC", "return to clinic"), ("PCP", "primary care provider"),
    ("BP", "blood pressure"), ("HR", "heart rate"), ("RR", "respiratory rate"),
    ("SpO2", "oxygen saturation"), ("NC", "nasal cannula"), ("y/o", "years old"),
)


def _reference_line(rng: random.Random, pools: _Pools) -> str:
    """Formulary / glossary / contact-page style lines (public reference material)."""
    kind = rng.randrange(4)
    if kind == 0:
        drug, doses, freqs = rng.choice(MEDICATIONS)
        return (f"{_cap(drug)}: usual dose {rng.choice(doses)} {rng.choice(freqs)}; "
                f"class: {_DRUG_CLASSES.get(drug, 'prescription medicine')}.")
    if kind == 1:
        abbr, meaning = rng.choice(_ABBREVIATIONS)
        return f"In medical writing, {abbr} means {meaning}."
    if kind == 2:
        y, m, d = rng.randint(1990, 2024), rng.randint(1, 12), rng.randint(1, 28)
        fmt = rng.randrange(3)
        date = (f"{y}-{m:02d}-{d:02d}" if fmt == 0 else f"{m:02d}/{d:02d}/{y}" if fmt == 1
                else f"{pools.months[m - 1]} {d}, {y}")
        return (f"The {rng.choice(('clinic', 'pharmacy', 'library', 'museum', 'office'))} in "
                f"{rng.choice(pools.cities)} reopened on {date}; call {rng.choice(pools.phones)} "
                f"or write to {rng.choice(pools.addresses)}.")
    temp = round(rng.uniform(35.8, 38.5), 1)
    return (f"Example vital signs: T {temp} C, BP {rng.randint(95, 180)}/{rng.randint(55, 105)}, "
            f"HR {rng.randint(50, 125)}, RR {rng.randint(12, 24)}, SpO2 {rng.randint(90, 100)}%.")


def _prose_line(rng: random.Random, pools: _Pools) -> str:
    tmpl = rng.choice(_PROSE)
    return tmpl.format(
        adj=rng.choice(("old", "new", "large", "small", "famous", "quiet")),
        noun=rng.choice(("bridge", "museum", "market", "theatre", "school", "harbour")),
        city=rng.choice(pools.cities), year=rng.randint(1800, 2024), n=rng.randint(2, 40),
        Company=rng.choice(pools.companies),
        product=rng.choice(("service", "device", "software release", "line of products")),
        weekday=rng.choice(pools.weekdays), country=rng.choice(pools.countries),
        month=rng.choice(pools.months),
        weather=rng.choice(("sunny", "rainy", "cold", "windy", "mild")),
        season=rng.choice(("spring", "summer", "autumn", "winter")),
        time=f"{rng.randint(5, 11)}:{rng.choice(('05', '15', '30', '45'))}",
        money=f"${rng.randint(2, 90)},{rng.randint(100, 999)}", day=rng.randint(1, 28),
    )


def generate_public_corpus(num_lines: int, seed: int) -> list[str]:
    """``num_lines`` lines of public text (medical-encyclopedic and general), deterministic.

    No line is, or is built from, a private record: no person names, record numbers,
    dates of birth or clinical-note headers are ever emitted.
    """
    rng = random.Random(f"llmdp-public-corpus-{seed}")
    fake = Faker("en_US")
    fake.seed_instance(10_000 + seed)
    pools = _Pools(fake)
    lines: list[str] = []
    for _ in range(num_lines):
        r = rng.random()
        if r < 0.45:
            k = rng.randint(1, 3)
            lines.append(" ".join(_encyclopedic_line(rng, pools) for _ in range(k)))
        elif r < 0.6:
            lines.append(_reference_line(rng, pools))
        elif r < 0.8:
            lines.append(_prose_line(rng, pools))
        else:
            # faker's generic English sentences (its lorem word list is common English words).
            lines.append(fake.paragraph(nb_sentences=rng.randint(1, 3)))
    return lines


def _train_bpe(lines: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def _make_portable(folder: str, fast) -> None:
    """Let transformers 4.x load the folder too (pyproject allows >= 4.45).

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, a name 4.x does not know,
    and no ``special_tokens_map.json``; ``PreTrainedTokenizerFast`` is the class both accept.
    """
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    special = {k: getattr(fast, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2, sort_keys=True)
        f.write("\n")


def train_public_tokenizer(
    out_dir,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    num_lines: int = DEFAULT_NUM_LINES,
    seed: int = 0,
) -> str:
    """Train a byte-level BPE on ``generate_public_corpus`` and save an HF tokenizer folder.

    The folder (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
    loads offline with ``AutoTokenizer.from_pretrained(out_dir)``. No BOS is added on
    encode; ``<s>``, ``</s>``, ``<pad>``, ``<unk>`` are ids 0-3. Written atomically.
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE, got {vocab_size}"
        )
    out_dir = os.path.abspath(os.fspath(out_dir))
    tok = _train_bpe(generate_public_corpus(num_lines, seed), vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=parent)
    try:
        os.chmod(tmp, folder_mode())  # mkdtemp makes it 0700
        fast.save_pretrained(tmp)
        _make_portable(tmp, fast)
        with open(os.path.join(tmp, "llmdp_tokenizer.json"), "w") as f:
            json.dump(
                {"kind": "public-bpe", "vocab_size": vocab_size, "num_lines": num_lines,
                 "seed": seed, "generator": "llmdp.tokenizer.public.generate_public_corpus"},
                f, indent=2, sort_keys=True,
            )
            f.write("\n")
        if os.path.isdir(out_dir):
            # Keep files we did not write (e.g. the README of the shipped artifact).
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    ap.add_argument("--num-lines", type=int, default=DEFAULT_NUM_LINES)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = train_public_tokenizer(args.out_dir, args.vocab_size, args.num_lines, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

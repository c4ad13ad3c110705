"""Synthetic *private* corpus: realistic-looking clinical notes for demos and tests.

Every record is invented (names, dates, addresses and MRNs come from ``faker``), but the
corpus has the shape that makes differential privacy matter: each patient (the ``user_id``)
has several notes, a few patients have very many, and the notes are full of identifiers
that a model must not memorize. The demo trains on it as if it were private data; the
demo tokenizer is deliberately *not* trained on it (see ``llmdp.tokenizer.public``).

Generation is deterministic for a seed and fast (5,000 notes in well under a second):
``faker`` is called once per patient and once per clinician, and everything per note is
drawn from one ``random.Random``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import random
import tempfile
from dataclasses import dataclass, field

from faker import Faker

# Public medical vocabularies (names of conditions and drugs are public knowledge, not
# records); ``llmdp.tokenizer.public`` reuses them to write encyclopedic text.
CONDITIONS: tuple[str, ...] = (
    "type 2 diabetes mellitus", "type 1 diabetes mellitus", "essential hypertension",
    "hyperlipidemia", "coronary artery disease", "atrial fibrillation",
    "congestive heart failure", "chronic obstructive pulmonary disease", "asthma",
    "community-acquired pneumonia", "chronic kidney disease stage 3", "acute kidney injury",
    "hypothyroidism", "hyperthyroidism", "osteoarthritis of the knee", "rheumatoid arthritis",
    "gout", "osteoporosis", "major depressive disorder", "generalized anxiety disorder",
    "bipolar disorder", "schizophrenia", "alcohol use disorder", "opioid use disorder",
    "migraine without aura", "epilepsy", "Parkinson's disease", "Alzheimer's dementia",
    "multiple sclerosis", "ischemic stroke", "transient ischemic attack",
    "deep vein thrombosis", "pulmonary embolism", "peripheral artery disease",
    "gastroesophageal reflux disease", "peptic ulcer disease", "irritable bowel syndrome",
    "Crohn's disease", "ulcerative colitis", "cirrhosis of the liver", "hepatitis C",
    "acute pancreatitis", "cholelithiasis", "urinary tract infection",
    "benign prostatic hyperplasia", "iron deficiency anemia", "vitamin B12 deficiency",
    "obstructive sleep apnea", "obesity", "psoriasis", "atopic dermatitis", "cellulitis",
    "herpes zoster", "HIV infection", "sepsis", "lumbar radiculopathy",
    "carpal tunnel syndrome", "glaucoma", "cataract", "allergic rhinitis",
    "chronic sinusitis", "breast cancer", "prostate cancer", "colorectal cancer",
    "non-small cell lung cancer",
)

# (drug, strengths, routes/frequencies)
MEDICATIONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("metformin", ("500 mg", "850 mg", "1000 mg"), ("PO BID", "PO daily with breakfast")),
    ("insulin glargine", ("10 units", "20 units", "32 units"), ("subcut at bedtime",)),
    ("insulin lispro", ("4 units", "6 units", "per sliding scale"), ("subcut with meals",)),
    ("lisinopril", ("5 mg", "10 mg", "20 mg", "40 mg"), ("PO daily",)),
    ("losartan", ("25 mg", "50 mg", "100 mg"), ("PO daily",)),
    ("amlodipine", ("2.5 mg", "5 mg", "10 mg"), ("PO daily",)),
    ("hydrochlorothiazide", ("12.5 mg", "25 mg"), ("PO daily",)),
    ("metoprolol succinate", ("25 mg", "50 mg", "100 mg"), ("PO daily",)),
    ("metoprolol tartrate", ("12.5 mg", "25 mg", "50 mg"), ("PO BID",)),
    ("carvedilol", ("3.125 mg", "6.25 mg", "12.5 mg"), ("PO BID",)),
    ("furosemide", ("20 mg", "40 mg", "80 mg"), ("PO daily", "IV BID")),
    ("spironolactone", ("25 mg", "50 mg"), ("PO daily",)),
    ("atorvastatin", ("10 mg", "20 mg", "40 mg", "80 mg"), ("PO nightly",)),
    ("rosuvastatin", ("5 mg", "10 mg", "20 mg"), ("PO daily",)),
    ("aspirin", ("81 mg", "325 mg"), ("PO daily",)),
    ("clopidogrel", ("75 mg",), ("PO daily",)),
    ("apixaban", ("2.5 mg", "5 mg"), ("PO BID",)),
    ("warfarin", ("2 mg", "5 mg", "7.5 mg"), ("PO daily, dose per INR",)),
    ("enoxaparin", ("40 mg", "1 mg/kg"), ("subcut daily", "subcut q12h")),
    ("levothyroxine", ("25 mcg", "50 mcg", "88 mcg", "112 mcg"), ("PO daily before breakfast",)),
    ("omeprazole", ("20 mg", "40 mg"), ("PO daily",)),
    ("pantoprazole", ("40 mg",), ("PO daily", "IV daily")),
    ("ondansetron", ("4 mg", "8 mg"), ("PO q8h PRN nausea", "IV q6h PRN nausea")),
    ("albuterol", ("90 mcg/actuation, 2 puffs",), ("inhaled q4-6h PRN wheezing",)),
    ("fluticasone-salmeterol", ("250/50 mcg",), ("inhaled BID",)),
    ("tiotropium", ("18 mcg",), ("inhaled daily",)),
    ("prednisone", ("5 mg", "10 mg", "40 mg"), ("PO daily", "PO daily x5 days")),
    ("sertraline", ("25 mg", "50 mg", "100 mg"), ("PO daily",)),
    ("escitalopram", ("5 mg", "10 mg", "20 mg"), ("PO daily",)),
    ("bupropion XL", ("150 mg", "300 mg"), ("PO daily",)),
    ("trazodone", ("50 mg", "100 mg"), ("PO at bedtime PRN insomnia",)),
    ("quetiapine", ("25 mg", "100 mg", "300 mg"), ("PO at bedtime",)),
    ("lithium carbonate", ("300 mg",), ("PO BID", "PO TID")),
    ("gabapentin", ("100 mg", "300 mg", "600 mg"), ("PO TID",)),
    ("levetiracetam", ("500 mg", "750 mg", "1000 mg"), ("PO BID",)),
    ("acetaminophen", ("500 mg", "650 mg", "1 g"), ("PO q6h PRN pain",)),
    ("ibuprofen", ("400 mg", "600 mg"), ("PO q8h PRN pain with food",)),
    ("oxycodone", ("5 mg", "10 mg"), ("PO q6h PRN severe pain",)),
    ("buprenorphine-naloxone", ("8/2 mg",), ("SL daily",)),
    ("allopurinol", ("100 mg", "300 mg"), ("PO daily",)),
    ("colchicine", ("0.6 mg",), ("PO daily", "PO BID during flare")),
    ("alendronate", ("70 mg",), ("PO weekly",)),
    ("tamsulosin", ("0.4 mg",), ("PO daily after dinner",)),
    ("ceftriaxone", ("1 g", "2 g"), ("IV daily",)),
    ("azithromycin", ("250 mg", "500 mg"), ("PO daily",)),
    ("amoxicillin-clavulanate", ("875/125 mg",), ("PO BID",)),
    ("nitrofurantoin", ("100 mg",), ("PO BID x5 days",)),
    ("vancomycin", ("1 g", "15 mg/kg"), ("IV q12h",)),
    ("piperacillin-tazobactam", ("4.5 g",), ("IV q6h",)),
    ("methotrexate", ("15 mg",), ("PO weekly",)),
    ("adalimumab", ("40 mg",), ("subcut every other week",)),
    ("cetirizine", ("10 mg",), ("PO daily",)),
    ("ferrous sulfate", ("325 mg",), ("PO daily",)),
    ("cyanocobalamin", ("1000 mcg",), ("IM monthly", "PO daily")),
    ("sumatriptan", ("50 mg", "100 mg"), ("PO PRN migraine",)),
)

ALLERGENS: tuple[str, ...] = (
    "penicillin", "sulfa drugs", "codeine", "morphine", "latex", "shellfish", "peanuts",
    "iodinated contrast", "amoxicillin", "cephalexin", "aspirin", "ibuprofen", "lisinopril",
    "eggs", "bee stings",
)
REACTIONS: tuple[str, ...] = (
    "hives", "rash", "anaphylaxis", "angioedema", "nausea", "itching", "throat swelling",
    "GI upset", "wheezing",
)

COMPLAINTS: tuple[str, ...] = (
    "chest pain", "shortness of breath", "cough for two weeks", "fever and chills",
    "abdominal pain", "nausea and vomiting", "headache", "dizziness", "low back pain",
    "knee pain", "fatigue", "palpitations", "swelling of both legs", "dysuria",
    "rash on the forearm", "follow-up of chronic conditions", "medication refill",
    "syncope", "confusion", "worsening anxiety", "poor sleep", "weight loss",
    "blood in stool", "sore throat", "ear pain", "fall at home", "hyperglycemia",
    "elevated blood pressure at home", "wheezing", "joint swelling",
)

NOTE_TYPES: tuple[str, ...] = (
    "Progress Note", "Clinic Visit", "Emergency Department Note", "Discharge Summary",
    "Telephone Encounter", "Consultation", "Admission History and Physical", "Follow-up Visit",
)
SPECIALTIES: tuple[str, ...] = (
    "Internal Medicine", "Family Medicine", "Cardiology", "Endocrinology", "Pulmonology",
    "Nephrology", "Psychiatry", "Neurology", "Gastroenterology", "Emergency Medicine",
    "Rheumatology", "Oncology",
)
CREDENTIALS: tuple[str, ...] = ("MD", "DO", "NP", "PA-C")

_HPI = (
    "{first} is a {age}-year-old {sex} with a history of {cond1} and {cond2} who presents with {cc}.",
    "{age} y/o {sex_short} with PMH of {cond1}, {cond2} presenting for {cc}.",
    "Patient reports {cc} that started {onset}. {pronoun} denies {neg}.",
    "{first} {last} returns today for {cc}. Since the last visit on {last_visit}, {pronoun_l} has been {course}.",
    "Seen today for {cc}, onset {onset}. Symptoms are {severity} and {pattern}.",
    "Called the clinic reporting {cc}. {pronoun} was advised to {advice}.",
)
_ONSET = (
    "3 days ago", "yesterday evening", "about a week ago", "two weeks ago", "this morning",
    "gradually over the past month", "after a long flight", "suddenly while at rest",
)
_NEG = (
    "fever, chills or night sweats", "chest pain or palpitations", "nausea or vomiting",
    "recent travel or sick contacts", "focal weakness or numbness", "blood in the urine",
    "shortness of breath at rest",
)
_COURSE = (
    "doing well overall", "having more trouble sleeping", "adherent to the medications",
    "missing some doses of the evening medications", "walking 30 minutes a day",
    "checking blood sugars twice a day", "feeling more short of breath on exertion",
)
_SEVERITY = ("mild", "moderate", "severe", "intermittent", "worsening", "improving")
_PATTERN = (
    "worse at night", "worse with exertion", "relieved by rest", "not related to meals",
    "associated with nausea", "without radiation",
)
_ADVICE = (
    "go to the emergency department if symptoms worsen",
    "hold the diuretic for two days and recheck weight",
    "continue current medications and schedule a visit",
    "start the new prescription sent to the pharmacy",
)
_EXAM = (
    "Lungs clear to auscultation bilaterally. Heart regular rate and rhythm, no murmurs.",
    "Mild bibasilar crackles. 1+ pitting edema of both ankles.",
    "Abdomen soft, mildly tender in the epigastrium, no rebound or guarding.",
    "Alert and oriented x3. Cranial nerves II-XII intact. Strength 5/5 throughout.",
    "Scattered expiratory wheezes, no accessory muscle use.",
    "Right knee with small effusion, crepitus on flexion, no erythema.",
    "Erythematous, warm, tender area on the left lower leg with well-demarcated borders.",
    "No acute distress. Oropharynx clear. No cervical lymphadenopathy.",
)
_ASSESS = (
    "{cond} - {status}. {plan_sentence}",
    "{cond}: {status}; {plan_sentence}",
    "# {cond}\n   {plan_sentence} {status_cap}.",
)
_STATUS = (
    "stable", "well controlled", "poorly controlled", "improving", "worsening",
    "new diagnosis", "at goal", "not at goal", "chronic, unchanged",
)
_PLAN = (
    "Continue {drug} {dose} {freq}.",
    "Increase {drug} to {dose} {freq}.",
    "Start {drug} {dose} {freq}.",
    "Decrease {drug} to {dose} {freq} given side effects.",
    "Discontinue {drug}; monitor for recurrence.",
    "Check {lab} in {weeks} weeks.",
    "Refer to {specialty} for further evaluation.",
    "Discussed diet, exercise and weight loss; patient agrees with the plan.",
    "Order {imaging} to rule out {rule_out}.",
    "Counseled on smoking cessation, 5 minutes spent.",
    "Reviewed home readings, average {sbp}/{dbp}.",
)
_LABS = (
    "HbA1c", "basic metabolic panel", "CBC", "lipid panel", "TSH", "INR", "liver function tests",
    "urinalysis", "BNP", "vitamin D level", "ferritin", "uric acid",
)
_IMAGING = (
    "chest X-ray", "CT of the abdomen and pelvis", "echocardiogram", "MRI of the lumbar spine",
    "renal ultrasound", "venous duplex of the left leg", "CT angiogram of the chest",
)
_RULE_OUT = (
    "pneumonia", "pulmonary embolism", "appendicitis", "deep vein thrombosis", "fracture",
    "nephrolithiasis", "cord compression",
)
_FOLLOW = (
    "Follow up in {n} weeks or sooner if symptoms worsen.",
    "Return to clinic in {n} months.",
    "RTC {n} weeks with labs prior.",
    "Follow-up with PCP in {n} days after discharge.",
    "Next appointment scheduled for {date}.",
    "Patient instructed to call with any questions. Follow up in {n} weeks.",
)


@dataclass
class _Patient:
    user_id: str
    first: str
    last: str
    sex: str
    dob: _dt.date
    mrn: str
    address: str
    phone: str
    conditions: list[str]
    meds: list[tuple[str, str, str]]
    allergies: list[tuple[str, str]] = field(default_factory=list)


def _notes_per_patient(rng: random.Random) -> int:
    """Skewed count: most patients have a handful of notes, ~1% are heavy users (50-120)."""
    if rng.random() < 0.01:
        return rng.randint(50, 120)
    return max(1, int(rng.lognormvariate(1.4, 0.9)))


def _make_patient(fake: Faker, rng: random.Random, index: int) -> _Patient:
    sex = rng.choice(("female", "male"))
    first = fake.first_name_female() if sex == "female" else fake.first_name_male()
    dob = _date_of_birth(fake, minimum_age=18, maximum_age=95)
    conds = rng.sample(CONDITIONS, rng.randint(1, 4))
    meds = []
    for drug, doses, freqs in rng.sample(MEDICATIONS, rng.randint(1, 6)):
        meds.append((drug, rng.choice(doses), rng.choice(freqs)))
    n_all = rng.choice((0, 0, 0, 1, 1, 2))
    allergies = [(a, rng.choice(REACTIONS)) for a in rng.sample(ALLERGENS, n_all)]
    return _Patient(
        user_id=f"P{index:06d}",
        first=first,
        last=fake.last_name(),
        sex=sex,
        dob=dob,
        mrn=f"{rng.randint(10_000_000, 99_999_999)}",
        address=fake.address().replace("\n", ", "),
        phone=fake.phone_number(),
        conditions=conds,
        meds=meds,
        allergies=allergies,
    )


#: "Today" for the generated dates of birth. Faker's ``date_of_birth`` counts ages from the
#: machine's current date, so the notes (and N, σ and every figure the README quotes for
#: `make demo`) moved with the calendar; fixed to the date those figures were made on.
REFERENCE_DATE = _dt.date(2026, 11, 24)


def _date_of_birth(fake: Faker, minimum_age: int, maximum_age: int) -> _dt.date:
    """Faker's ``date_of_birth`` (the same draws from ``fake``) with ages counted from
    ``REFERENCE_DATE``, not from the current date: the same dates on every day."""
    from faker.providers.date_time import change_year

    start = change_year(REFERENCE_DATE, -(maximum_age + 1))
    end = change_year(REFERENCE_DATE, -minimum_age)
    dob = fake.date_time_ad(start_datetime=start, end_datetime=end).date()
    return dob if dob != start else dob + _dt.timedelta(days=1)


def _age(dob: _dt.date, on: _dt.date) -> int:
    return on.year - dob.year - ((on.month, on.day) < (dob.month, dob.day))


def _fmt_date(d: _dt.date, rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return d.isoformat()
    if style == 1:
        return f"{d.month:02d}/{d.day:02d}/{d.year}"
    return d.strftime("%B %d, %Y").replace(" 0", " ")


def _plan_sentence(rng: random.Random, p: _Patient) -> str:
    tmpl = rng.choice(_PLAN)
    drug, doses, freqs = rng.choice(MEDICATIONS)
    if p.meds and rng.random() < 0.6:
        drug, dose, freq = rng.choice(p.meds)
    else:
        dose, freq = rng.choice(doses), rng.choice(freqs)
    return tmpl.format(
        drug=drug, dose=dose, freq=freq, lab=rng.choice(_LABS), weeks=rng.choice((2, 4, 6, 12)),
        specialty=rng.choice(SPECIALTIES).lower(), imaging=rng.choice(_IMAGING),
        rule_out=rng.choice(_RULE_OUT), sbp=rng.randint(118, 168), dbp=rng.randint(68, 98),
    )


def _note_text(rng: random.Random, p: _Patient, author: str, date: _dt.date,
               last_visit: _dt.date | None) -> str:
    age = _age(p.dob, date)
    cc = rng.choice(COMPLAINTS)
    note_type = rng.choice(NOTE_TYPES)
    pronoun = "She" if p.sex == "female" else "He"
    conds = p.conditions + ([rng.choice(CONDITIONS)] if rng.random() < 0.3 else [])
    lines: list[str] = []

    # Header: identifiers in one of a few layouts.
    if rng.random() < 0.5:
        lines.append(f"{note_type.upper()} - {rng.choice(SPECIALTIES)}")
        lines.append(f"Patient: {p.last}, {p.first}    MRN: {p.mrn}    DOB: {_fmt_date(p.dob, rng)}")
        lines.append(f"Date of service: {_fmt_date(date, rng)}    Provider: {author}")
    else:
        lines.append(f"{note_type}")
        lines.append(f"Name: {p.first} {p.last}  |  MRN: {p.mrn}  |  DOB: {p.dob.isoformat()} ({age} y)")
        lines.append(f"Seen on {_fmt_date(date, rng)} by {author}")
        if rng.random() < 0.3:
            lines.append(f"Address: {p.address}  Phone: {p.phone}")

    lines.append("")
    lines.append(f"Chief complaint: {cc}")
    hpi = rng.choice(_HPI).format(
        first=p.first, last=p.last, age=age, sex=p.sex, sex_short=p.sex[0].upper(),
        cond1=conds[0], cond2=conds[-1] if len(conds) > 1 else "no other chronic illness",
        cc=cc, onset=rng.choice(_ONSET), pronoun=pronoun, pronoun_l=pronoun.lower(),
        neg=rng.choice(_NEG), course=rng.choice(_COURSE),
        last_visit=_fmt_date(last_visit, rng) if last_visit else "intake",
        severity=rng.choice(_SEVERITY), pattern=rng.choice(_PATTERN), advice=rng.choice(_ADVICE),
    )
    lines.append(f"HPI: {hpi}")

    if rng.random() < 0.8:
        lines.append("Past medical history: " + "; ".join(conds) + ".")
    if rng.random() < 0.85:
        lines.append("Medications:")
        for drug, dose, freq in p.meds:
            lines.append(f"  - {drug} {dose} {freq}")
    if p.allergies:
        lines.append("Allergies: " + ", ".join(f"{a} ({r})" for a, r in p.allergies))
    else:
        lines.append(rng.choice(("Allergies: NKDA", "Allergies: no known drug allergies")))

    if note_type != "Telephone Encounter":
        temp = round(rng.gauss(36.9, 0.5), 1)
        lines.append(
            f"Vitals: T {temp} C, BP {rng.randint(98, 182)}/{rng.randint(56, 104)}, "
            f"HR {rng.randint(52, 124)}, RR {rng.randint(12, 26)}, "
            f"SpO2 {rng.randint(88, 100)}% on {rng.choice(('room air', 'room air', '2 L NC'))}"
            + (f", weight {rng.randint(48, 140)} kg" if rng.random() < 0.5 else "")
        )
        if rng.random() < 0.6:
            lines.append("Exam: " + rng.choice(_EXAM))

    lines.append("Assessment and plan:")
    for i, cond in enumerate(rng.sample(conds, min(len(conds), rng.randint(1, 3)))):
        status = rng.choice(_STATUS)
        item = rng.choice(_ASSESS).format(
            cond=cond, status=status, status_cap=status.capitalize(),
            plan_sentence=_plan_sentence(rng, p),
        )
        lines.append(f"{i + 1}. {item}")
    follow_date = date + _dt.timedelta(days=rng.randint(7, 120))
    lines.append(rng.choice(_FOLLOW).format(n=rng.randint(2, 6), date=_fmt_date(follow_date, rng)))
    lines.append(f"Electronically signed by {author} on {_fmt_date(date, rng)}.")
    return "\n".join(lines)


def generate_clinical_notes(num_documents: int, seed: int) -> list[dict]:
    """``num_documents`` synthetic clinical notes, deterministic for ``seed``.

    Records: ``{"doc_id", "user_id", "author", "date", "text"}``. ``user_id`` is the patient:
    about 7 notes per patient on average, heavily skewed (about 1% of patients have 50-120).
    """
    if num_documents < 0:
        raise ValueError(f"num_documents must be >= 0, got {num_documents}")
    rng = random.Random(f"llmdp-private-notes-{seed}")
    fake = Faker("en_US")
    fake.seed_instance(seed)

    n_authors = max(4, min(60, num_documents // 80))
    authors = []
    for _ in range(n_authors):
        authors.append(f"{fake.first_name()} {fake.last_name()}, {rng.choice(CREDENTIALS)}")

    counts: list[int] = []
    while sum(counts) < num_documents:
        counts.append(_notes_per_patient(rng))
    if counts:
        counts[-1] -= sum(counts) - num_documents

    start = _dt.date(2015, 1, 1)
    records: list[dict] = []
    for pi, count in enumerate(counts):
        p = _make_patient(fake, rng, pi)
        # The patient's clinicians: most notes come from one or two of them.
        care_team = rng.sample(authors, min(len(authors), rng.randint(1, 3)))
        days = sorted(rng.randrange(0, 3650) for _ in range(count))
        last = None
        for j, d in enumerate(days):
            date = start + _dt.timedelta(days=d)
            author = rng.choice(care_team) if rng.random() < 0.85 else rng.choice(authors)
            text = _note_text(rng, p, author, date, last)
            records.append({
                "doc_id": f"{p.user_id}-{j:03d}",
                "user_id": p.user_id,
                "author": author,
                "date": date.isoformat(),
                "text": text,
            })
            last = date
    rng.shuffle(records)
    return records


def write_jsonl(records, path) -> str:
    """Write ``records`` as JSON lines to ``path`` (atomically: temp file + rename)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False))
                f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def ensure_clinical_notes(path, num_documents: int, seed: int) -> str:
    """Generate the corpus at ``path`` unless a file is already there; return ``path``.

    The write is atomic, so concurrent callers (several Ray workers) never see a partial
    file; whichever finishes last replaces an identical file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        write_jsonl(generate_clinical_notes(num_documents, seed), path)
    return path


if __name__ == "__main__":  # pragma: no cover - manual inspection
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for rec in generate_clinical_notes(n, 0)[:n]:
        print(json.dumps({k: v for k, v in rec.items() if k != "text"}))
        print(rec["text"])
        print("-" * 80)

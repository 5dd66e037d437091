"""A code-editing prompt (Spec-Bench has none): the answer mostly copies the given code."""

CODE = """def parse_records(lines):
    records = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, age, city = line.split(",")
        records.append({"name": name.strip(), "age": int(age), "city": city.strip()})
    return records


def average_age(records):
    if not records:
        return 0.0
    total = 0
    for record in records:
        total += record["age"]
    return total / len(records)


def group_by_city(records):
    groups = {}
    for record in records:
        groups.setdefault(record["city"], []).append(record)
    return groups
"""

CODE_EDIT_PROMPTS = [
    "Rename the variable `records` to `people` everywhere in this Python code and return the "
    "full code:\n\n" + CODE,
    "Add type hints to every function in this Python code and return the full code:\n\n" + CODE,
]

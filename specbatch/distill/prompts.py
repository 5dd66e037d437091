"""A diverse, deterministic prompt set for self-distillation, built offline from templates.

Instructions, questions, translation, summarisation and explanation of real text (Python standard
library docstrings), code tasks and chat. Nothing here comes from the Spec-Bench evaluation set.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

TOPICS = [
    "the ocean",
    "autumn",
    "a lighthouse",
    "friendship",
    "the moon",
    "coffee",
    "a busy city",
    "mountains",
    "the first day of school",
    "a lost key",
    "rain",
    "a robot learning to paint",
    "an old library",
    "the desert at night",
    "a train journey",
    "gardening",
    "a snowstorm",
    "the internet",
    "a village market",
    "a dragon",
    "time travel",
    "a small bakery",
    "climate change",
    "the human brain",
    "volcanoes",
    "bees",
    "the Roman empire",
    "jazz music",
    "renewable energy",
    "black holes",
    "a football match",
    "the printing press",
    "chess",
    "honesty",
    "a childhood memory",
    "electric cars",
    "the immune system",
    "bridges",
    "ancient Egypt",
    "photosynthesis",
    "a rainforest",
    "public transport",
    "the stock market",
    "vaccines",
    "the water cycle",
    "social media",
    "a detective",
    "a space station",
]
CONCEPTS = [
    "recursion",
    "inflation",
    "machine learning",
    "gravity",
    "democracy",
    "compound interest",
    "natural selection",
    "supply and demand",
    "the greenhouse effect",
    "encryption",
    "a binary search",
    "entropy",
    "the Pythagorean theorem",
    "opportunity cost",
    "DNA",
    "a neural network",
    "plate tectonics",
    "the scientific method",
    "a hash function",
    "probability",
    "an operating system",
    "electric current",
    "the French Revolution",
    "a database index",
    "photosynthesis",
    "relativity",
    "the blockchain",
    "a compiler",
    "the placebo effect",
    "a black hole",
    "the stock exchange",
    "an algorithm",
]
SENTENCES = [
    "The weather is beautiful today.",
    "Where is the nearest train station?",
    "I would like a cup of tea, please.",
    "My brother works as an engineer in Berlin.",
    "We are going to the beach this weekend.",
    "Could you help me with my homework?",
    "The museum opens at nine in the morning.",
    "She has read every book in the series.",
    "Please turn off the lights when you leave.",
    "This restaurant serves excellent pasta.",
    "How much does this jacket cost?",
    "The meeting has been moved to Thursday.",
    "I forgot my umbrella at home.",
    "They adopted a small dog last year.",
]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese"]
CODE_TASKS = [
    "checks whether a string is a palindrome",
    "returns the n-th Fibonacci number",
    "merges two sorted lists",
    "counts the words in a text",
    "removes duplicates from a list",
    "computes the factorial of a number",
    "finds the largest element in a list",
    "reverses a linked list",
    "parses a CSV line into fields",
    "validates an email address",
    "converts Celsius to Fahrenheit",
    "flattens a nested list",
    "computes a moving average",
    "checks whether a number is prime",
    "sorts a list of dictionaries by a key",
    "reads a file and returns its lines",
    "implements binary search",
    "groups words by their first letter",
    "computes the greatest common divisor",
]
TEMPLATES = [
    "Write a short poem about {topic}.",
    "Write a short story about {topic}.",
    "Describe {topic} in three sentences.",
    "Give me five interesting facts about {topic}.",
    "Write a blog post introduction about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a haiku about {topic}.",
    "Compose a product description inspired by {topic}.",
    "Explain {concept} in simple terms.",
    "Explain {concept} to a ten-year-old.",
    "What is {concept}? Give an example.",
    "Compare {concept} and {concept2}.",
    "Write a quiz question about {concept} with the answer.",
    "Translate to {language}: {sentence}",
    "Translate the following into {language}: {sentence}",
    "Write a Python function that {task}.",
    "Write a Python function that {task}, with a docstring and type hints.",
    "Explain step by step how to write code that {task}.",
    "What is {a} + {b}?",
    "What is {a} times {b}? Show your work.",
    "If I have {a} apples and give away {b}, how many are left?",
    "Rewrite this sentence more formally: {sentence}",
    "Correct the grammar: {sentence}",
    "Give me three tips about {topic}.",
    "Plan a one-day trip focused on {topic}.",
]


def stdlib_docstrings(limit: int, min_chars: int = 200) -> list[str]:
    """Function and class docstrings from the Python standard library on this machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    found.append(doc[:1500])
        if len(found) >= limit:
            break
    return found[:limit]


def build_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts: templates filled at random plus summarise/explain prompts
    over standard-library docstrings."""
    rng = random.Random(seed)
    prompts: dict[str, None] = {}
    docs = stdlib_docstrings(limit=max(50, count // 5))
    for doc in docs:
        verb = rng.choice(
            [
                "Summarize this text:",
                "Explain this documentation in plain words:",
                "List the key points of the following:",
            ]
        )
        prompts[f"{verb}\n\n{doc}"] = None
    attempts = 0
    while len(prompts) < count and attempts < count * 50:
        attempts += 1
        template = rng.choice(TEMPLATES)
        concept, concept2 = rng.sample(CONCEPTS, 2)
        prompts[
            template.format(
                topic=rng.choice(TOPICS),
                concept=concept,
                concept2=concept2,
                language=rng.choice(LANGUAGES),
                sentence=rng.choice(SENTENCES),
                task=rng.choice(CODE_TASKS),
                a=rng.randint(2, 99),
                b=rng.randint(2, 99),
            )
        ] = None
    ordered = list(prompts)
    rng.shuffle(ordered)
    return ordered[:count]


def stdlib_source_chunks(max_chars: int, chunk_chars: int = 2000) -> Iterator[str]:
    """Plain Python source text from the standard library, in chunks."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for start in range(0, len(text), chunk_chars):
            yield text[start : start + chunk_chars]
            total += chunk_chars
            if total >= max_chars:
                return


PERSONAS = [
    "a pirate captain",
    "a medieval knight",
    "a friendly librarian",
    "a tour guide in Rome",
    "a detective in the 1920s",
    "a chef on a cooking show",
    "an astronaut on Mars",
    "a wise old wizard",
    "a sports commentator",
    "a museum curator",
]
COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Australia",
    "Mexico",
    "Kenya",
    "Norway",
    "Argentina",
    "Vietnam",
]
FIELDS = ["biology", "economics", "physics", "history", "philosophy", "computer science"]
# Families the base set lacks: extraction, questions over passages, longer summaries, role play,
# word problems, factual questions, paragraph translation, letters and essays. Every template
# takes the same fields (unused ones are ignored by ``str.format``).
EXTRA_TEMPLATES = [
    "Extract every function or parameter name mentioned in the text below and list them.\n\n{doc}",
    "Extract the key facts from the following text as a bulleted list.\n\n{doc}",
    "Read the text below and return a JSON object with the fields 'topic' and 'summary'.\n\n{doc}",
    "Answer the question using only the passages below.\n\nPassage 1: {doc}\n\nPassage 2: "
    "{doc2}\n\nQuestion: what is the main purpose described in passage 1?",
    "Given these documents, explain how the two are related.\n\nDocument A:\n{doc}\n\n"
    "Document B:\n{doc2}",
    "Summarize the following article in three sentences.\n\n{doc}\n\n{doc2}",
    "Write a one-paragraph summary of this text for a newsletter.\n\n{doc}",
    "Pretend you are {persona}. Describe {topic} to your audience.",
    "You are {persona}. Greet a visitor and tell them about {concept}.",
    "Stay in character as {persona} and give advice about {topic}.",
    "A train travels {a} kilometres in {b} hours. What is its average speed? Explain.",
    "A shop sells pens at {a} cents each. How much do {b} pens cost? Think step by step.",
    "Tom has {a} marbles. He buys {b} more and then gives half away. How many does he have?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is the capital of {country}, and what is it known for?",
    "Who first described {concept}, and when?",
    "Name three famous people from {country} and say why they are known.",
    "Translate this paragraph into {language}: {sentence} {sentence2}",
    "How would you say the following in {language}? {sentence2}",
    "Write an email to a colleague about {topic}.",
    "Write a persuasive essay opening about {topic}.",
    "Write a letter to a friend describing a trip to {country}.",
    "Describe the role of {concept} in {field}.",
    "What are the main open questions in {field} today?",
    "Give a step-by-step explanation of {concept}, with one example per step.",
    "Write a dialogue between {persona} and a student about {concept}.",
    "Continue this story in one paragraph: {sentence}",
    "Write a numbered list of ten ideas related to {topic}.",
]


def extra_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts of the families ``build_prompts`` lacks (a separate,
    deterministic stream: it does not change ``build_prompts``' list)."""
    rng = random.Random(seed + 1)
    docs = stdlib_docstrings(limit=2000, min_chars=300)
    prompts: dict[str, None] = {}
    attempts = 0
    while len(prompts) < count and attempts < count * 50:
        attempts += 1
        concept, concept2 = rng.sample(CONCEPTS, 2)
        sentence, sentence2 = rng.sample(SENTENCES, 2)
        doc, doc2 = rng.sample(docs, 2)
        prompts[
            rng.choice(EXTRA_TEMPLATES).format(
                topic=rng.choice(TOPICS),
                concept=concept,
                concept2=concept2,
                language=rng.choice(LANGUAGES),
                sentence=sentence,
                sentence2=sentence2,
                task=rng.choice(CODE_TASKS),
                a=rng.randint(2, 99),
                b=rng.randint(2, 99),
                doc=doc,
                doc2=doc2,
                persona=rng.choice(PERSONAS),
                country=rng.choice(COUNTRIES),
                field=rng.choice(FIELDS),
            )
        ] = None
    return list(prompts)[:count]

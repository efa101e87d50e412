"""Answer and format rewards: the last stated answer, exact numbers, Math-Verify for the rest, hedges, no raise."""

import signal
import sys
import threading

import pytest

import grpo
from grpo import answer_reward, format_reward

COT = "Janet's ducks lay 16 eggs. She eats 3 and bakes with 4, so 16 - 3 - 4 = 9 remain; 9 * $2 = $18."
GSM8K_REFERENCE = "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
MATH_REFERENCE = "The distance is $\\sqrt{8} = \\boxed{2\\sqrt{2}}$."
STEPS = "Let the two parts be $a$ and $b$.\nThen $a + b = 5$ and $a - b = 1$.\n"  # PRM800K's style
SUB_RESULT = STEPS + "So the answer is \\boxed{3} for the first part.\nThe total is $3 \\cdot 2 = 6$.\n\n# Answer\n\n6"

ANSWER_CASES = [
    # numbers: compared exactly as fractions, whatever the spelling
    ("5", "5", 1.0),  # the built-in task
    ("05", "5", 1.0),
    ("6", "5", 0.0),
    (COT + "\n#### 18", "18", 1.0),
    (COT + "\n#### 18", GSM8K_REFERENCE, 1.0),  # a worked reference: its #### line is the answer
    (COT + "\n#### 17", GSM8K_REFERENCE, 0.0),
    (COT + "\n#### $18.00", "18", 1.0),
    (COT + "\n#### 18 dollars", "18", 1.0),
    (COT + "\nThe answer is $18.", "18", 1.0),
    (COT + "\nThe final answer is $\\boxed{18}$.", "18", 1.0),
    (COT, "18", 1.0),  # the last number
    ("The total is $1,234.", "1234", 1.0),
    ("The total is \\$1{,}234.", "1234", 1.0),
    ("She saves 20%.\n#### 20%", "20", 1.0),
    ("Each gets \\boxed{\\dfrac{1}{2}} of a pizza.", "0.5", 1.0),
    ("The answer is 0.33.", "1/3", 0.0),  # exact, not rounded
    ("The answer is 5 million.", "5", 0.0),
    ("The area is 18x.", "18", 0.0),  # a coefficient states nothing
    ("#### Step 1: eggs left\n16 - 3 - 4 = 9\n#### Step 2: money\n9 * 2 = 18\nThe answer is 18.", "18", 1.0),
    # hedges and cut-offs state no answer
    (COT + "\n#### 18\n#### 20", "18", 0.0),
    (COT + "\n#### 18\n#### 18", "18", 1.0),
    ("It is either \\boxed{18} or \\boxed{20}.", "18", 0.0),
    ("\\boxed{16} \\boxed{17} \\boxed{18} \\boxed{19}", "18", 0.0),
    ("So 9 * 2 = 18.\nThe final answer is \\boxed{18", "18", 0.0),  # cut at the token limit inside the box
    ("Thus \\boxed{\\frac{1}{2", "\\frac{1}{2}", 0.0),
    ("I am not sure.", "18", 0.0),
    ("", "18", 0.0),
    # symbolic answers: Math-Verify
    ("Therefore the answer is $\\boxed{\\sqrt{8}}$.", MATH_REFERENCE, 1.0),
    ("Therefore the answer is $\\boxed{2\\sqrt{3}}$.", MATH_REFERENCE, 0.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\left(1, 2\\right)}", "(1, 2)", 1.0),
    ("\\boxed{(2, 1)}", "(1, 2)", 0.0),
    ("\\boxed{1 + x^2}", "x^2+1", 1.0),
    ("\\boxed{x^2 - 1}", "x^2+1", 0.0),
    ("\\boxed{x \\in [2,5)}", "[2,5)", 1.0),
    ("\\boxed{[2, 5]}", "[2,5)", 0.0),
    ("\\boxed{\\frac{3\\sqrt{5}}{5}}", "\\frac{3}{\\sqrt{5}}", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{1024}", "2^{10}", 1.0),
    ("Thus, $AB = 2\\sqrt{3}$.", "2\\sqrt{3}", 1.0),  # no box: the last sentence's last $...$
    ("Let us expand $(x+1)^2$ carefully. Expanding, we find", "(x+1)^2", 0.0),  # cut before the answer
    ("The answer is either $\\boxed{\\frac{1}{2}}$ or $\\boxed{\\frac{1}{3}}$.", "\\frac{1}{2}", 0.0),
    # the answer stated last counts: a sub-result, a checked option or a first guess stated before it does not
    (SUB_RESULT, "6", 1.0),
    (SUB_RESULT, "3", 0.0),
    ("This matches choice (B), so the answer is (B). But the count is 9 * 2 = 18.\n#### 18", "18", 1.0),
    ("A first guess is \\boxed{9}. Doubling it, she makes \\boxed{18}.", "18", 1.0),
    (STEPS + "# Answer\n\n5 or 6", "5", 0.0),  # a hedge...
    (STEPS + "# Answer\n\n5 or 6", "5, 6", 1.0),  # ... is a list
    ("The solutions are $\\boxed{5}$ and $\\boxed{6}$.", "5, 6", 1.0),
    (STEPS + "So the answer is \\boxed{5}.\n\n# Answer\n\n6", "6", 1.0),  # a "# Answer" heading has the last word
    (STEPS + "So the answer is $x = 6$.\n\n# Answer\n\n6", "6", 1.0),
    ("So our answer is correct. $x = 74$", "74", 1.0),  # "answer is correct" is prose, not an answer
    # a stated answer is read whole: numbers as written, expressions by Math-Verify, never a number picked out of one
    ("# Answer\n\n3\\frac{6}{11}", "\\frac{39}{11}", 1.0),  # a mixed number
    ("# Answer\n\n3\\frac{6}{11}", "\\frac{6}{11}", 0.0),
    ("(49/10)^2", "24.01", 1.0),
    ("(49/10)^2", "4.9", 0.0),
    ("\\boxed{2\\tan A\\tan B+2}", "2+2\\tan A \\tan B", 1.0),
    ("\\boxed{2\\tan A\\tan B+2}", "2", 0.0),
    ("\\boxed{3\\sqrt[3]{2}}", "2", 0.0),
    ("The population is 32 million.\n#### 32 million", "32,\\!000,\\!000", 1.0),
    ("#### 32 million", "32", 0.0),
    ("The answer is 31.95/2.", "15.975", 1.0),  # a decimal over an integer
    ("\\boxed{6\\text{ cm}^2}", "6", 1.0),
    # references as public data writes them
    ("The answer is 0.2.", ".2", 1.0),
    ("The answer is 2.", ".2", 0.0),
    (COT + "\nThe answer is 18.", "A: 18", 1.0),
    ("The answer is 18, because she sells 9 eggs at $2.", "18", 1.0),  # the answer, not the reason after it
    ("The answer is 1, 2, 3", "1, 2, 3", 1.0),
    ("#### 12:30", "12{:}30", 1.0),  # what Math-Verify cannot read still matches itself
    # conventions: fractions in lowest terms (MATH asks for them), an equation's sign (the problem fixes it), words
    ("\\boxed{\\frac{72}{375}}", "\\frac{24}{125}", 0.0),
    ("\\boxed{0.192}", "\\frac{24}{125}", 1.0),
    ("\\boxed{-x + 2y - z + 3 = 0}", "x - 2y + z - 3 = 0", 0.0),
    ("\\boxed{x - 2y + z = 3}", "x - 2y + z - 3 = 0", 1.0),
    ("\\boxed{LXQS}", "LQSX", 0.0),
    ("\\boxed{\\text{(C)}}", "C", 1.0),
]


@pytest.mark.parametrize("completion, answer, expected", ANSWER_CASES)
def test_answer_reward(completion, answer, expected):
    assert answer_reward(completion, answer) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("5", 1.0),
        ("-3.5", 1.0),
        ("05", 0.0),
        ("5.", 0.0),
        ("five", 0.0),
        (COT + "\n#### 18", 1.0),
        (COT + "\n#### 1,234.", 1.0),
        (COT + "\n#### 18 dollars", 0.0),
        ("So the answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
        ("\\[ \\boxed{18} \\]", 1.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{18} is the answer", 0.0),
        ("The answer is \\boxed{18", 0.0),
        (COT, 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion, "18") == expected


def test_math_verify_runs_without_alarms():
    handler = signal.getsignal(signal.SIGALRM)
    signal.setitimer(signal.ITIMER_REAL, 1000.0)  # a caller's own alarm must survive the reward
    try:
        results = []
        worker = threading.Thread(target=lambda: results.append(answer_reward("\\boxed{\\sqrt{12}}", "2\\sqrt{3}")))
        worker.start()
        worker.join()
        assert results == [1.0]  # (Math-Verify's own timeouts raise in a thread)
        assert answer_reward("\\boxed{\\frac{6}{\\sqrt{3}}}", "2\\sqrt{3}") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 900  # still armed, not cancelled by signal.alarm(0)
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_pathological_answers_are_refused_before_math_verify(monkeypatch):
    monkeypatch.setattr(grpo, "symbolic_equal", lambda stated, reference: pytest.fail("Math-Verify was called"))
    for stated in ("9^{9^{9^{9}}}", "10^{1000000000}", "100000!", "9" * 5000, "x+" * 200 + "1"):  # sympy: minutes
        assert answer_reward(f"The answer is $\\boxed{{{stated}}}$.", "2\\sqrt{3}") == 0.0
    junk = ["(10^{100})!", "\\binom{100000}{50000}", "(5", "5+", "/5", "()", "5="]  # slow for sympy, or no maths at all
    for stated in junk:
        assert answer_reward(stated, "2\\sqrt{3}") == answer_reward(stated, "5") == 0.0
    assert answer_reward("+5", "5") == 1.0


def test_malformed_answers_never_raise():
    texts = [
        "",
        "\\boxed{",
        "}{",
        "\\frac{1}{0}",
        "31.95/2",
        "3/0",
        "1.5/0.0",
        "9" * 5000,
        "10^{10^{10}}",
        "(10^{100})!",
        "\\boxed{" * 300,
        "\x00\xff\u2212",
        "# Answer\n\n",
        "#### ",
        "x=",
        "==",
        "1,,000 million",
        "\\begin{pmatrix}",
    ]
    results = []
    worker = threading.Thread(target=lambda: results.extend(answer_reward(a, b) for a in texts for b in texts + ["2"]))
    worker.start()
    worker.join(timeout=10)  # sympy, unguarded, takes minutes on some of these
    assert not worker.is_alive() and set(results) <= {0.0, 1.0} and len(results) == len(texts) * (len(texts) + 1)


def test_missing_math_verify_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # (None in sys.modules makes the import fail)
    assert answer_reward("#### 18", "18") == 1.0  # numbers need no Math-Verify
    with pytest.raises(grpo.UserError, match="pip install math-verify"):
        answer_reward("\\boxed{y^3 + 7}", "7 + y^3")

from skyrl_cli.recipe.locator import line_of, locate_keys

SOURCE = '''\
# comment = not a key
name = "x"
a.b = 1

[model]
init = { hidden_size = 64,
         layers = 2 }
tokenizer = "char"   # trailing comment

[rl.async]
max_staleness = 2
text = """
fake = 1
"""
"quoted key" = 3

[[items]]
k = 1
[[items]]
k = 2
'''


def test_tables_keys_and_dotted_keys():
    lines = locate_keys(SOURCE)
    assert lines[("name",)] == 2
    assert lines[("a",)] == 3 and lines[("a", "b")] == 3
    assert lines[("model",)] == 5
    assert lines[("model", "init")] == 6
    assert lines[("model", "tokenizer")] == 8
    assert lines[("rl", "async")] == 10
    assert lines[("rl", "async", "max_staleness")] == 11
    assert lines[("rl", "async", "quoted key")] == 15


def test_multiline_values_hide_their_contents():
    lines = locate_keys(SOURCE)
    assert ("model", "layers") not in lines
    assert ("rl", "async", "fake") not in lines


def test_arrays_of_tables_are_indexed():
    lines = locate_keys(SOURCE)
    assert lines[("items", 0, "k")] == 18
    assert lines[("items", 1, "k")] == 20


def test_lookup_falls_back_to_the_longest_prefix():
    lines = locate_keys(SOURCE)
    assert line_of(lines, ("model", "init", "hidden_size")) == 6  # inside the inline table
    assert line_of(lines, ("model", "lora", "rank")) == 5  # missing key: its table
    assert line_of(lines, ("nothing",)) == 1

"""What ``narrate file`` refuses before anything starts: one line on stderr, exit code 2, and no
process, no Valkey, not even a data directory (in-process, milliseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from narrate.cli import build_parser, main, reads_as_markdown
from narrate.file import InputError, output_and_format, read_text_file

BOOK = "# One\n\nHello there. How are you?\n"


@pytest.fixture
def narrate(tmp_path, monkeypatch, capsys):
    """Run ``narrate file ...`` in-process; returns (exit code, stderr, whether a data dir appeared)."""
    data = tmp_path / "data"
    monkeypatch.setenv("NARRATE_DATA_DIR", str(data))
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args: str):
        code = main(["file", *args])
        return code, capsys.readouterr().err, data.exists()

    return run


def write(tmp_path, name, content: bytes | str):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("missing.md", None, "missing.md: no such file"),
        ("folder", "dir", "folder: is a directory, not a text file"),
        ("empty.md", "  \n\t\n", "empty.md: is empty: there is nothing to narrate"),
        (
            "picture.md",
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "picture.md: looks like a binary file, not text",
        ),
        (
            "latin1.txt",
            "Caf\xe9 cr\xe8me".encode("latin-1"),
            "latin1.txt: is not UTF-8 text (byte 0xe9 at offset 3)",
        ),
        ("code.md", "```\nonly code\n```\n", "text has nothing to narrate"),
        ("paper.pdf", b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n", "paper.pdf: is a PDF; narrate reads text (.txt, .md) and EPUB"),
    ],
)
def test_bad_input_files_are_one_line_and_exit_2_before_anything_starts(
    narrate, tmp_path, name, content, says
):
    if content == "dir":
        (tmp_path / name).mkdir()
        path = str(tmp_path / name)
    elif content is None:
        path = str(tmp_path / name)
    else:
        path = write(tmp_path, name, content)
    code, err, started = narrate(path)
    assert code == 2 and says in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not started  # no data directory: nothing was started


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-o", "book.flac", "--format", "wav"], "book.flac: the extension says flac but --format says wav"),
        (
            ["-o", "book.mp4"],
            "book.mp4: cannot tell the format from .mp4; name the file .wav or .flac or .m4b or .m4a or "
            ".mp3 or .opus, or say --format",
        ),
        (["--voice", "nobody"], "unknown voice 'nobody'"),
        (["-o", "book.m4b", "--bitrate", "1000"], "bitrate 1000 kb/s is out of range for m4b: 16-320"),
        (["-o", "book.wav", "--bitrate", "64"], "wav is lossless: it takes no bitrate"),
        (["--rate", "5"], "rate"),
        (["--model", "nothing"], "unknown model 'nothing'"),
        # found before the book is narrated, not after
        (["-o", "book.md/out.wav"], "book.md/out.wav: "),
    ],
)
def test_contradictions_and_unknown_choices_exit_2_before_anything_starts(narrate, tmp_path, args, says):
    code, err, started = narrate(write(tmp_path, "book.md", BOOK), *args)
    assert code == 2 and says in err and not started, err


def test_a_utf_16_file_with_its_mark_is_text(tmp_path):
    path = tmp_path / "u16.txt"
    for encoding in ("utf-16-le", "utf-16-be"):
        path.write_bytes(("\ufeff" + BOOK).encode(encoding))
        assert read_text_file(path, 1000) == BOOK


def test_an_unreachable_redis_is_one_line_before_any_worker_starts(narrate, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    code, err, _ = narrate(write(tmp_path, "book.md", BOOK))
    assert code == 2 and err.startswith("narrate: cannot reach Redis at redis://127.0.0.1:1/0") and "Traceback" not in err
    assert not (tmp_path / "data" / "logs").exists()  # no worker was started
    assert main(["keys", "list"]) == 2 and "cannot reach Redis" in capsys.readouterr().err


def test_chapters_that_name_none_are_refused_and_a_format_in_capitals_is_taken(narrate, tmp_path):
    from testing.epubkit import sample_book

    code, err, started = narrate(write(tmp_path, "book.epub", sample_book(3)), "--chapters", ",,")
    assert code == 2 and "--chapters names no chapter" in err and not started  # not "every chapter"
    assert build_parser().parse_args(["file", "a.md", "--format", "MP3"]).format == "mp3"


def test_a_txt_file_is_plain_text_as_over_http_unless_said(capsys):
    def reads(name: str, *flags: str) -> bool:
        args = build_parser().parse_args(["file", name, *flags])
        return reads_as_markdown(Path(name), args)

    assert [reads("a.txt"), reads("a.md"), reads("a.epub"), reads("a")] == [False, True, True, True]
    assert [reads("a.txt", "--markdown"), reads("a.md", "--plain")] == [True, False]
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["file", "a.txt", "--plain", "--markdown"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_the_format_follows_the_output_extension(tmp_path):
    src = tmp_path / "book.md"
    assert output_and_format(src, "out/book.flac", None) == (tmp_path.__class__("out/book.flac"), "flac")
    assert output_and_format(src, "book.FLAC", "flac")[1] == "flac"
    assert output_and_format(src, None, "flac") == (tmp_path / "book.flac", "flac")
    assert output_and_format(src, None, None) == (tmp_path / "book.wav", "wav")
    assert output_and_format(src, "book.audio", "wav")[1] == "wav"  # an unknown extension, said explicitly
    with pytest.raises(InputError, match="is the input file"):
        output_and_format(src, str(src), "wav")


def test_every_option_has_help(capsys):
    import argparse

    from narrate.cli import build_parser

    def undocumented(parser, path):
        for action in parser._actions:
            if action.dest != "help" and not action.help:
                yield f"{path} {action.option_strings or action.dest}"
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from undocumented(sub, f"{path} {name}")

    assert list(undocumented(build_parser(), "narrate")) == []

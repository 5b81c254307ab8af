#!/usr/bin/env bash
# Writes the language model's text: the King James Version of the Bible, one verse per line,
# without the verse references ("Ge1:1 In the beginning ..." becomes "In the beginning ...").
#
#   scripts/make-corpus.sh OUT.txt
#
# The text: the Authorized (King James) Version of 1611, the 66 books from Genesis to Revelation,
# 31 102 verses, about 4.3 MB of English, as Debian's packages bible-kjv (the `bible` program)
# and bible-kjv-text (its text) install it; scripts/setup.sh installs both. Its licence: the
# translation's copyright has expired (made in 1611; /usr/share/doc/bible-kjv-text/copyright says
# so), so the text is in the public domain, and the package's retrieval data may be copied,
# modified and distributed at will. (In the United Kingdom alone the Crown's letters patent still
# govern printing the KJV.) Nothing is downloaded: the text comes from the installed package.
#
# The file appears whole or not at all (written next to OUT.txt, then renamed). Without the
# `bible` program, or with a text that is not what the package ships: one line, exit 2.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/make-corpus.sh OUT.txt" >&2
  exit 2
fi
out=$1
if ! command -v bible >/dev/null 2>&1; then
  echo "make-corpus: the 'bible' program is not installed (Debian: apt-get install bible-kjv bible-kjv-text, or scripts/setup.sh)" >&2
  exit 2
fi
dir=$(dirname -- "$out")
if [ ! -d "$dir" ]; then
  echo "make-corpus: directory '$dir' does not exist" >&2
  exit 2
fi
tmp=$(mktemp "$dir/.$(basename -- "$out").tmp-XXXXXX")
trap 'rm -f "$tmp"' EXIT

# Every verse is one line "<book><chapter>:<verse> <text>", the book abbreviated with an optional
# leading digit ("Ge", "1Sa", "SSol"). Lines that do not start so are kept whole (there are none).
bible -f "Genesis 1:1-Revelation 22:21" | sed -E 's/^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ //' >"$tmp"

verses=$(wc -l <"$tmp")
if [ "$verses" -ne 31102 ] || grep -qE '^[1-3]?[A-Za-z]+[0-9]+:[0-9]+ ' "$tmp"; then
  echo "make-corpus: 'bible' printed $verses lines, not the 31102 verses of the KJV without their references" >&2
  exit 2
fi
chmod "$(printf '%o' $((0666 & ~$(umask))))" "$tmp"  # as any new file, not mktemp's 0600
mv -f "$tmp" "$out"
trap - EXIT

#!/usr/bin/env bash
# `make sabotage`: a check of the tests. Each tests/sabotage/NAME.patch is a one-line break of a feature; applied to a
# copy of this tree (the working tree's tracked files; data/ linked), the tests its `Test:` lines name must FAIL
# there (pytest status 1). A sabotage its tests survive is a test that passes with its feature broken: status 1.
# Usage: tests/sabotage/run.sh [NAME ...] (default: all). Not part of `make test` (it reruns slow tests per patch).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
# absolute, but not resolved: the tests run from the copy, and a venv's python is a link that must stay one
python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=($(cd "$root/tests/sabotage" && ls *.patch | sed 's/\.patch$//'))
survived=0
for name in "${names[@]}"; do
    patch_file="$root/tests/sabotage/$name.patch"
    tests=$(sed -n 's/^Test: //p' "$patch_file")
    copy=$(mktemp -d /tmp/sabotage.XXXXXX)
    (cd "$root" && git ls-files -z | grep -zv '^data$' | xargs -0 tar cf - 2>/dev/null) | tar xf - -C "$copy"
    [ -e "$root/data" ] && ln -sfn "$(readlink -f "$root/data")" "$copy/data"
    if ! patch -s -p1 -d "$copy" < "$patch_file"; then
        echo "sabotage $name: the patch no longer applies (update it to the code)"; survived=1; rm -rf "$copy"; continue
    fi
    (cd "$copy" && PYTHONPATH="$copy" MNIST_DATA_DIR="$root/data" "$python" -m pytest -x -q -p no:cacheprovider \
        $tests > "$copy/pytest.log" 2>&1)
    status=$?
    if [ $status -eq 1 ]; then
        echo "sabotage $name: caught ($(grep -m1 -E '^FAILED' "$copy/pytest.log" | cut -c1-150))"
    else
        echo "sabotage $name: NOT caught (pytest status $status; 0 = the tests passed with the feature broken)"
        tail -5 "$copy/pytest.log"; survived=1
    fi
    rm -rf "$copy"
done
exit $survived

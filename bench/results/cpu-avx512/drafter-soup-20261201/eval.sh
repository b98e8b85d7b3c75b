set -e
R=".venv/bin/redrafter-mlx eval-drafter --replay --json"
for d in /tmp/cand; do
  $R --drafter $d --widths 1 --lengths 4 > /tmp/kb/eval/mt-cand.json 2>/dev/null
  $R --drafter $d --widths 1 --lengths 4 --heldout --num-prompts 48 > /tmp/kb/eval/held-cand.json 2>/dev/null
  $R --drafter $d --widths 1 --lengths 4 --heldout --corpus data/corpus/smollm2-135m-self --num-prompts 48 > /tmp/kb/eval/self-cand.json 2>/dev/null
  $R --drafter $d --draft lookup-else-rnn --widths 1 --lengths 3,4 > /tmp/kb/eval/def-cand.json 2>/dev/null
  $R --drafter $d --draft lookup-else-rnn --widths 1 --lengths 3,4 --heldout --num-prompts 48 > /tmp/kb/eval/held-default-cand.json 2>/dev/null
  $R --drafter $d --draft lookup-else-rnn --widths 1 --lengths 3,4 --heldout --corpus data/corpus/smollm2-135m-self --num-prompts 48 > /tmp/kb/eval/self-default-cand.json 2>/dev/null
done
R2="$R --drafter default --draft lookup-else-rnn --widths 1 --lengths 3,4"
$R2 --heldout --num-prompts 48 > /tmp/kb/eval/held-default-shipped.json 2>/dev/null
$R2 --heldout --corpus data/corpus/smollm2-135m-self --num-prompts 48 > /tmp/kb/eval/self-default-shipped.json 2>/dev/null
$R2 > /tmp/kb/eval/def-shipped.json 2>/dev/null
echo done

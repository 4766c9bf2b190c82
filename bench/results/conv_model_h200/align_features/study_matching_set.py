"""Adds to study.py's cached problems the minimum analytic cost and cost factor over every kernel of the sweep whose
signature matches the problem (what select ranks before td_can_run), for study.py's MATCH=1 variant."""
import sys, pickle, gzip, json, collections
sys.path.insert(0,'bench/sweeps'); sys.path.insert(0,'runtime')
import numpy as np
from tiledispatch import learned
from tiledispatch.spec.key import parse_kernel_name as pk
task=sys.argv[1]
probs=pickle.load(open(f'/tmp/probs2_{task}.pkl','rb'))
allnames=set()
with gzip.open(f'bench/results/sweeps/{task}_cutlass_sm90a.jsonl.gz','rt') as f:
    for line in f:
        r=json.loads(line)
        if 'kernel' in r: allnames.add(r['kernel'])
keys={n:pk(n) for n in allnames}
names=list(learned.FEATURES['conv'])
ia, ic = names.index('log2_analytic_cost'), names.index('log2_cost_factor')
for p in probs:
    q=p['problem']
    match=sorted(n for n,k in keys.items() if q.mismatch(k) is None)
    x=learned.features(q,[keys[n] for n in match])
    p['match_min']=(x[:,ia].min(), x[:,ic].min(), len(match))
pickle.dump(probs, open(f'/tmp/probs2_{task}.pkl','wb'))
print(task, np.mean([p['match_min'][2] for p in probs]))

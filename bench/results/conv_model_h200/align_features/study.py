"""The held-out feature / objective study behind study.json (run from the repository root at a3d8204, before the
alignment columns were part of learned.features; kept as the record of how the numbers were made, not as a tool):

    python3 study.py conv_fwd '[{"objective": "regression"}]'             # the baseline
    EXTRA=1 NOKV=1 python3 study.py conv_fwd '[{"objective": "regression"}]'   # + the two problem alignment columns

Environment switches add columns (EXTRA: alignment, NOKV: without the kernel's vector width; REL: analytic cost and
cost factor relative to the candidates' minimum, MATCH: relative to the signature-matching kernels' instead (needs
study_matching_set.py first); REL2 / REL3 / SPAT / SPEC / GREL: the other variants of study.json); the JSON argument
lists LightGBM variants (objective, seed, weight). Problems are cached as pickles in /tmp.
"""
import sys, time, pickle, json, os
from pathlib import Path
sys.path.insert(0,'bench/sweeps'); sys.path.insert(0,'runtime')
import numpy as np, lightgbm as lgb
import train as T
from tiledispatch import learned
task = sys.argv[1]
cache = Path(f'/tmp/probs2_{task}.pkl')
if cache.exists():
    probs = pickle.loads(cache.read_bytes())
else:
    t=time.time()
    d = T.load_problems([f'bench/results/sweeps/{task}_cutlass_sm90a.jsonl.gz'])
    probs = d[('cutlass','sm90a',task)]['problems']
    cache.write_bytes(pickle.dumps(probs)); print('loaded', len(probs), time.time()-t)
op = 'gemm' if task=='gemm' else 'conv'
import math
def pow2(v, cap=16):
    a=1
    while a<cap and v % (2*a)==0: a*=2
    return a
def kvec(key):
    ex=dict(key.algorithm.extras) if key.algorithm.extras else {}
    for k,v in ex.items():
        if k.endswith('align'): return v
    return 8
def extra_cols(p):
    q=p['problem']; ca=pow2(q.c//q.g); ka=pow2(q.k//q.g)
    pa = min(ca,ka)
    kv=np.array([kvec(k) for k in p['keys']],float)
    cols=[np.full(len(kv),math.log2(ca)),np.full(len(kv),math.log2(ka))] + ([] if os.environ.get('NOKV')=='1' else [np.log2(kv),np.log2(pa)-np.log2(kv)])
    if os.environ.get('SPAT')=='1':
        n=len(kv); cols += [np.full(n, math.log2(q.out_size[-1])), np.full(n, math.log2(q.out_size[0])), np.full(n, float(q.filter_size[-1]))]
    if os.environ.get('REL')=='1':
        names=list(learned.FEATURES['conv'])
        a=p['x'][:,names.index('log2_analytic_cost')]; cf=p['x'][:,names.index('log2_cost_factor')]
        if os.environ.get('MATCH')=='1': cols += [a-p['match_min'][0], cf-p['match_min'][1]]
        else: cols += [a-a.min(), cf-cf.min()]
        if os.environ.get('REL2')=='1':
            cols += [np.argsort(np.argsort(a,kind='stable'),kind='stable')/len(a), np.full(len(a), math.log2(len(a)))]
        if os.environ.get('REL3')=='1':
            for f in ('log2_tiles','edge_fill','last_wave_fill','log2_k_iterations'):
                v=p['x'][:,names.index(f)]; cols.append(v-v.max())
    if os.environ.get('SPEC')=='1':
        ex=[dict(k.algorithm.extras or ()) for k in p['keys']]
        cols += [np.array([float('cutlass.fx' in e or 'cutlass.fy' in e) for e in ex]), np.array([float('cutlass.cpg' in e) for e in ex]), np.array([float(e.get('cutlass.occupancy',0)) for e in ex])]
    return np.column_stack(cols)
EXTRA = os.environ.get('EXTRA')=='1'
if os.environ.get('GREL')=='1':
    gi=list(learned.FEATURES['gemm']).index('log2_analytic_cost')
    for p in probs: a=p['x'][:,gi]; p['x']=np.column_stack([p['x'],a-a.min()])
if EXTRA:
    for p in probs: p['x']=np.column_stack([p['x'],extra_cols(p)])
def labels(p, scheme):
    r = p['times'].min()/p['times']
    if scheme == 'lin30': return np.clip(np.floor(r*30),0,30).astype(int)
    if scheme == 'sq30': return np.clip(np.floor(r**4*30),0,30).astype(int)
    if scheme == 'exp': return np.clip(np.floor(30*np.exp(-(1/r-1)*5)),0,30).astype(int)
def fit(train, variant):
    x = np.concatenate([p['x'] for p in train])
    if variant['objective']=='regression':
        y = np.concatenate([p['times'].min()/p['times'] for p in train])
        w = None
        if variant.get('weight') == 'per_problem':
            w = np.concatenate([np.full(len(p['times']), 1/len(p['times'])) for p in train]); w *= len(w)/w.sum()
        elif variant.get('weight') == 'sqrt':
            w = np.concatenate([np.full(len(p['times']), 1/np.sqrt(len(p['times']))) for p in train]); w *= len(w)/w.sum()
        elif variant.get('weight') == 'top':
            w = 1 + y**4
        ds = lgb.Dataset(x, y, weight=w)
    else:
        y = np.concatenate([labels(p, variant['labels']) for p in train])
        ds = lgb.Dataset(x, y, group=[len(p['times']) for p in train])
    params = {**T.PARAMS, **{k:v for k,v in variant.items() if k not in ('labels','weight')}}
    return lgb.train(params, ds, num_boost_round=variant.get('rounds',300))
def evaluate(variant, folds=5):
    effs=[]
    for f in range(folds):
        test=[p for p in probs if T.shape_fold(p['id'],folds)==f]
        train=[p for p in probs if T.shape_fold(p['id'],folds)!=f]
        b = fit(train, variant)
        for p in test:
            effs.append(T.efficiency(p, b.predict(p['x'])))
    s=T.summary(effs); return {k:round(v,4) for k,v in s.items()}
variants = json.loads(sys.argv[2])
for v in variants:
    t=time.time(); r=evaluate(v); print(json.dumps(v), r, f'{time.time()-t:.0f}s', flush=True)

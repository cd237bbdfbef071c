"""Plan fronts: MaOEA-CS against NSGA-III, AGE-MOEA2 (pymoo) and random search at equal budgets.

Method. Four cases (two shipped mixed clusters, the shipped three-vendor cluster, a 1024-device
four-type cluster), four objectives (throughput, cost, memory headroom, energy). Every algorithm
works on the same encoding (:mod:`hetero.planner.encoding`, the same repair), starts from the same
initial population per seed (the single-objective planner's best plans and each group's best plan
alone, encoded, topped up with uniform random vectors), has the same population size and exactly
the same number of evaluations (evaluations past the budget are refused, not counted). A run's
front is the non-dominated set of every plan it evaluated (what ``hetero plan --objectives``
returns). Per case, objectives are turned to minimisation and normalised by the ideal and nadir
points of the union front of all runs; hypervolume takes the reference point 1.1 in every
objective; IGD is measured against that union front. Means over 5 seeds.

Needs the [moo] extra (pymoo; AGE-MOEA2 needs numba).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_planner_scale import four_type_cluster  # noqa: E402  (the planner-scale benchmark's cluster)

OBJECTIVES = ("throughput", "cost", "memory_headroom", "energy")
ALGORITHMS = ("MaOEA-CS", "NSGA-III", "AGE-MOEA2", "random")
ABLATION = "MaOEA-CS phase 2 only"
"""A diagnostic variant (``--algorithms``): the corner search ends after the first generation."""
REF = 1.1


def cases():
    c, m = ROOT / "configs" / "clusters", ROOT / "configs" / "models"
    return {
        "a100-v100 / gpt3-1.3b": (lambda: hetero.load_cluster(c / "a100-v100.yaml"), m / "gpt3-1.3b.yaml", 256),
        "h100-a100 / llama3-8b": (lambda: hetero.load_cluster(c / "h100-a100.yaml"), m / "llama3-8b.yaml", 256),
        "mixed-vendor (3 vendors) / llama2-7b": (lambda: hetero.load_cluster(c / "mixed-vendor.yaml"),
                                                 m / "llama2-7b.yaml", 256),
        "four-type-1024 / llama2-70b": (lambda: four_type_cluster(1024), m / "llama2-70b.yaml", 2048),
    }


class _Budgeted:
    """A PlanProblem that refuses evaluations past the budget (pymoo may ask for a last generation)."""

    def __init__(self, problem, budget: int):
        self.p, self.budget = problem, budget

    def __call__(self, X):
        rows = []
        for x in np.asarray(X, dtype=float):
            if self.p.evaluations < self.budget:
                rows.append(self.p.evaluate_x(x))
            else:
                rows.append(np.full(len(self.p.names), 1e30))
        return np.array(rows)


def run_one(algo: str, problem, X0: np.ndarray, budget: int, pop: int, seed: int):
    from hetero.planner.maoea_cs import maoea_cs

    f = _Budgeted(problem, budget)
    if algo in ("MaOEA-CS", ABLATION):
        maoea_cs(f, problem.n_var, budget, pop_size=pop, X0=X0, seed=seed,
                 **({"corner_share": 0.0} if algo == ABLATION else {}))
    elif algo == "random":
        f(X0)
        rng = np.random.default_rng(seed)
        f(rng.random((budget - len(X0), problem.n_var)))
    else:
        from pymoo.core.problem import Problem
        from pymoo.optimize import minimize

        class P(Problem):
            def __init__(self):
                super().__init__(n_var=problem.n_var, n_obj=len(problem.names), xl=0.0, xu=1.0)

            def _evaluate(self, X, out, *args, **kwargs):
                out["F"] = f(X)

        if algo == "NSGA-III":
            from pymoo.algorithms.moo.nsga3 import NSGA3
            from pymoo.util.ref_dirs import get_reference_directions

            alg = NSGA3(ref_dirs=get_reference_directions("das-dennis", len(problem.names), n_partitions=4),
                        pop_size=pop, sampling=X0)
        else:
            from pymoo.algorithms.moo.age2 import AGEMOEA2

            alg = AGEMOEA2(pop_size=pop, sampling=X0)
        minimize(P(), alg, ("n_eval", budget + pop), seed=seed, verbose=False)
    return problem


def plot(results: dict, path: str) -> None:
    """Bars of mean hypervolume and IGD (error bars: one standard deviation) per case and algorithm."""
    from hetero.plots import load_pyplot, png_bytes

    plt = load_pyplot("--plot")
    names = list(results["cases"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    algorithms = list(next(iter(results["cases"].values()))["summary"])
    width = 0.8 / len(algorithms)
    colours = ["#c44e52", "#4c72b0", "#55a868", "#8c8c8c", "#dd8452"]
    for ax, key, label in ((axes[0], "hypervolume", "hypervolume (higher is better)"),
                           (axes[1], "igd", "IGD to the union front (lower is better)")):
        for k, algo in enumerate(algorithms):
            mean = [results["cases"][n]["summary"][algo][f"{key}_mean"] for n in names]
            sd = [results["cases"][n]["summary"][algo][f"{key}_sd"] for n in names]
            ax.bar(np.arange(len(names)) + (k - (len(algorithms) - 1) / 2) * width, mean, width, yerr=sd, label=algo, color=colours[k],
                   capsize=2)
        ax.set_xticks(np.arange(len(names)))
        ax.set_xticklabels([n.replace(" / ", "\n") for n in names], fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"plan fronts, 4 objectives, {results['budget']} evaluations per run, mean of {results['seeds']} seeds",
                 fontsize=10)
    fig.tight_layout()
    Path(path).write_bytes(png_bytes(fig))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=400, help="evaluations per run")
    ap.add_argument("--pop", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", nargs="*", help="case names (substrings) to run")
    ap.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS),
                    help=f"of {', '.join(ALGORITHMS + (ABLATION,))}")
    ap.add_argument("-o", default=str(ROOT / "benchmarks" / "results" / "objectives.json"))
    ap.add_argument("--plot", metavar="PNG", help="draw the hypervolume and IGD bars of the results")
    ap.add_argument("--plot-only", action="store_true", help="draw --plot from the JSON of -o, run nothing")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(json.loads(Path(args.o).read_text()), args.plot)
        return 0
    from pymoo.indicators.hv import HV
    from pymoo.indicators.igd import IGD

    from hetero.planner.front import PlanProblem, seed_plans
    from hetero.planner.maoea_cs import non_dominated

    out = {"method": __doc__, "objectives": list(OBJECTIVES), "budget": args.budget, "pop_size": args.pop,
           "seeds": args.seeds, "reference_point": REF, "cores": os.cpu_count(), "cases": {}}
    for name, (make, model_path, B) in cases().items():
        if args.cases and not any(s in name for s in args.cases):
            continue
        cluster, model = make(), hetero.load_model(model_path)
        t0 = time.perf_counter()
        seeds = seed_plans(cluster, model, B)
        seed_s = time.perf_counter() - t0
        shared = None
        runs = {a: [] for a in args.algorithms}
        for s in range(args.seeds):
            for algo in args.algorithms:
                problem = PlanProblem(cluster, model, B, OBJECTIVES, fallback=seeds["fastest"])
                if shared is None:
                    shared = (problem.enc, problem.scorer)
                problem.enc, problem.scorer = shared   # warm caches only: every run counts its own evaluations
                for plan in seeds.values():
                    problem.evaluate_plan(plan)
                rng = np.random.default_rng(1000 + s)
                X0 = np.array([problem.enc.encode(p) for p in seeds.values()])
                X0 = np.vstack([X0, rng.random((args.pop - len(X0), problem.n_var))])[: args.pop]
                t = time.perf_counter()
                run_one(algo, problem, X0, args.budget, args.pop, s)
                el = time.perf_counter() - t
                F = np.array([problem.sign * np.array([r.objectives[n] for n in OBJECTIVES]) for r in problem.records])
                runs[algo].append({"seed": s, "evaluations": problem.evaluations, "seconds": el,
                                   "front": F[non_dominated(F)].tolist()})
                print(f"{name:40s} {algo:10s} seed {s}: {problem.evaluations} evaluations, "
                      f"{len(runs[algo][-1]['front'])} on its front, {el:.1f} s", flush=True)
        union = np.vstack([np.array(r["front"]) for rs in runs.values() for r in rs])
        union = union[non_dominated(union)]
        ideal, nadir = union.min(0), union.max(0)
        span = np.where(nadir - ideal > 1e-12, nadir - ideal, 1.0)
        pf = (union - ideal) / span
        hv, igd = HV(ref_point=np.full(len(OBJECTIVES), REF)), IGD(pf)
        table = {}
        for algo, rs in runs.items():
            hvs, igds = [], []
            for r in rs:
                Fn = (np.array(r["front"]) - ideal) / span
                hvs.append(float(hv(Fn)))
                igds.append(float(igd(Fn)))
                r["hypervolume"], r["igd"] = hvs[-1], igds[-1]
            table[algo] = {"hypervolume_mean": float(np.mean(hvs)), "hypervolume_sd": float(np.std(hvs)),
                           "igd_mean": float(np.mean(igds)), "igd_sd": float(np.std(igds)),
                           "evaluations": [r["evaluations"] for r in rs],
                           "front_size_mean": float(np.mean([len(r["front"]) for r in rs])),
                           "seconds_median": float(np.median([r["seconds"] for r in rs]))}
        out["cases"][name] = {"devices": cluster.num_devices, "global_batch_size": B, "seed_search_s": seed_s,
                              "ideal": ideal.tolist(), "nadir": nadir.tolist(), "union_front_size": len(union),
                              "summary": table,
                              "runs": {a: [{k: v for k, v in r.items() if k != "front"} for r in rs]
                                       for a, rs in runs.items()}}
        for algo, row in table.items():
            print(f"{name:40s} {algo:10s} HV {row['hypervolume_mean']:.4f} +- {row['hypervolume_sd']:.4f}  "
                  f"IGD {row['igd_mean']:.4f} +- {row['igd_sd']:.4f}  front {row['front_size_mean']:.1f}", flush=True)
        Path(args.o).write_text(json.dumps(out, indent=1))
    if {"MaOEA-CS", "NSGA-III"} <= set(args.algorithms):
        wins = sum(1 for c in out["cases"].values()
                   if c["summary"]["MaOEA-CS"]["hypervolume_mean"] >= c["summary"]["NSGA-III"]["hypervolume_mean"])
        print(f"MaOEA-CS hypervolume >= NSGA-III's on {wins} of {len(out['cases'])} cases")
    print(f"written {args.o}")
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

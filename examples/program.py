"""A braid program on the embedded model: roles, select, a typed gen, and fork/join.

python examples/program.py
"""

import braid as sgl


@sgl.function
def trip(s, city):
    s += sgl.system("You are a concise travel assistant.")
    with s.user():
        s += "I am visiting " + city + ". Should I go in summer or winter?"
    with s.assistant():
        s += "I recommend going in"
        s += sgl.select("season", choices=[" summer", " winter"])
        s += ". Number of days I suggest: "
        s += sgl.gen_int("days", max_tokens=3)
        s += ".\n"
    with s.user():
        s += "Give me two quick tips."
    tips = s.fork(2)
    for i, f in enumerate(tips):
        with f.assistant():
            f += f"Tip {i + 1}:"
            f += sgl.gen("tip", max_tokens=24, stop="\n")
    tips.join()


if __name__ == "__main__":
    with sgl.Engine() as engine:  # the embedded SmolLM2-135M-Instruct
        sgl.set_default_backend(engine)
        state = trip.run(city="Oslo", temperature=0)
        print("season:", state["season"].strip(), "| days:", state["days"])
        for tip in state["tip"]:
            print("-", tip.strip())
        print(trip.trace())

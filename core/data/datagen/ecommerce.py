"""Synthetic e-commerce episodes: a returns/exchanges customer-service agent on the
tau2-bench retail tools (``datasets/ecommerce/tools.json``).

The world follows tau2's retail policy in small (authentication before writes, cancel or
modify pending orders, return or exchange delivered ones within 30 days, disputes to a
human), and each request reads what the customer's order state needs.  Behaviours:
``resolve``, ``escalate``, ``upsell`` and ``oscillate`` (each with a ``resolve`` twin);
outcomes follow the returns-bot formula of S004 §3.2.

Details: docs/datasets.md (## E-commerce: the world, ## E-commerce: behaviours,
## E-commerce: outcomes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.data.datagen.common import Draws, Recorder, check_args, normal_from

DOMAIN = "ecommerce"
TZ = "-05:00"
BEHAVIOURS = ("resolve", "escalate", "upsell", "oscillate")
SHARES = {"resolve": 0.40, "escalate": 0.20, "upsell": 0.25, "oscillate": 0.15}
PAIRS = {"oscillate": "resolve"}

TASK_TYPES = ("return_item", "exchange_item", "cancel_order", "modify_order", "update_address",
              "order_status", "refund_dispute")
_TYPE_WEIGHTS = np.array([0.22, 0.20, 0.16, 0.12, 0.10, 0.10, 0.10])

#: Names of the scalar features in ``observation["state"]``.
STATE_FEATURES = ("hour", "turn", "authenticated", "order_known", "order_pending", "order_delivered",
                  "days_since_delivery", "order_total", "user_sentiment", "writes_done", "failed_calls")

RETURN_WINDOW_DAYS = 30

_PRODUCTS = (  # name, option kind, options, price range
    ("T-Shirt", "size", ("S", "M", "L", "XL"), 15, 45),
    ("Running Shoes", "size", ("8", "9", "10", "11", "12"), 60, 160),
    ("Water Bottle", "capacity", ("500ml", "750ml", "1000ml"), 15, 40),
    ("Desk Lamp", "color", ("black", "white", "silver"), 30, 120),
    ("Mechanical Keyboard", "switch type", ("linear", "tactile", "clicky"), 70, 220),
    ("Bluetooth Speaker", "color", ("black", "blue", "red"), 40, 180),
    ("Hiking Boots", "size", ("7", "8", "9", "10", "11"), 90, 250),
    ("Office Chair", "material", ("mesh", "leather", "fabric"), 120, 450),
    ("Backpack", "color", ("black", "grey", "green", "navy"), 35, 150),
    ("Wireless Earbuds", "color", ("black", "white"), 50, 250),
    ("Smart Watch", "band", ("silicone", "leather", "metal"), 150, 450),
    ("Coffee Maker", "type", ("drip", "espresso", "pour-over"), 40, 300),
    ("Yoga Mat", "thickness", ("4mm", "6mm", "8mm"), 20, 80),
    ("Electric Kettle", "material", ("glass", "stainless steel", "plastic"), 25, 90),
)
_FIRST = ("Mia", "Noah", "Olivia", "Liam", "Emma", "Yusuf", "Sofia", "Ethan", "Aarav", "Chen", "Isabella",
          "Lucas", "Amelia", "Mei", "Omar", "Ava", "Raj", "Lena", "Daiki", "Fatima")
_LAST = ("Garcia", "Smith", "Kim", "Patel", "Nguyen", "Rossi", "Mueller", "Silva", "Johnson", "Brown",
         "Lopez", "Ahmed", "Wang", "Kowalski", "Hernandez", "Davis", "Ito", "Santos")
_CITIES = (("Austin", "TX", "787"), ("Denver", "CO", "802"), ("Seattle", "WA", "981"),
           ("Columbus", "OH", "432"), ("Phoenix", "AZ", "850"), ("Boston", "MA", "021"),
           ("Portland", "OR", "972"), ("Charlotte", "NC", "282"))
_STREETS = ("Maple Avenue", "Oak Street", "Cedar Lane", "Elm Drive", "Pine Road", "Lakeview Boulevard",
            "Hillcrest Way", "River Street")
#: Return-policy category of each product (the policy is per category).
_CATEGORY = {"T-Shirt": "apparel", "Running Shoes": "footwear", "Hiking Boots": "footwear",
             "Water Bottle": "kitchen", "Coffee Maker": "kitchen", "Electric Kettle": "kitchen",
             "Desk Lamp": "home", "Office Chair": "home", "Backpack": "bags", "Yoga Mat": "sports",
             "Mechanical Keyboard": "electronics", "Bluetooth Speaker": "electronics",
             "Wireless Earbuds": "electronics", "Smart Watch": "electronics"}
_CONDITION = {"apparel": "unworn, with tags attached", "footwear": "unworn, in the original box",
              "kitchen": "unused, in the original packaging", "home": "undamaged, with all parts",
              "bags": "unused, with tags attached", "sports": "unused, in the original packaging",
              "electronics": "with all accessories and the original packaging"}
_CARRIERS = ("UPS", "FedEx", "USPS", "DHL eCommerce")
#: What a customer disputes, and the record that shows it: the payment history (a second
#: charge), the carrier's tracking (marked delivered, never received), the return policy
#: (a breakage reported long after the return window).
DISPUTES = ("double_charge", "not_received", "late_breakage")
_RETURN_REASONS = ("it doesn't fit", "it arrived damaged", "I changed my mind",
                   "the quality is worse than expected", "it stopped working after a week")

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "return_item": (
        "Hi, I'd like to return the {product} from order {order}; {reason}.",
        "I want to send back the {product} I received, {reason}.",
        "How do I return a {product}? {Reason}.",
        "Please process a return for the {product} in order {order}.",
        "The {product} I bought isn't what I expected, I want to return it for a refund.",
        "Can I get my money back for the {product}? {Reason}.",
    ),
    "exchange_item": (
        "Can I exchange my {product} for the {new} {kind} instead of {old}?",
        "I got the {product} in {old} but I need {new}, please swap it.",
        "I'd like to exchange the {product} from order {order} for a different {kind} ({new}).",
        "The {old} {product} is wrong for me; can you exchange it for {new}?",
        "Please exchange my {product}: {kind} {old} to {new}.",
    ),
    "cancel_order": (
        "Please cancel my order {order} right away, I {cancel_text}.",
        "I {cancel_text}: cancel the {product} order asap, before it ships.",
        "Can you cancel order {order}? I {cancel_text}.",
        "I want to cancel the {product} I ordered yesterday.",
        "Cancel my pending order for the {product} today, please.",
    ),
    "modify_order": (
        "Can I change the {product} in my pending order to {new} {kind}?",
        "Before it ships, quickly switch my {product} from {old} to {new}.",
        "Please modify order {order}: I want the {product} in {new}, not {old}.",
        "I picked the wrong {kind} for the {product}; make it {new} before it ships.",
        "Update my pending {product} order to the {new} version please.",
    ),
    "update_address": (
        "I moved, please update my default address to {address}.",
        "Change my shipping address to {address}.",
        "Can you update the address on my account? New one is {address}.",
        "My address changed to {address}; please fix it in my profile.",
    ),
    "order_status": (
        "Where is my order {order}?",
        "Has my {product} shipped yet?",
        "What's the status of my order with the {product}?",
        "I'm still waiting for order {order}, I need it by tomorrow; can you check on it?",
        "Any update on when my {product} will arrive?",
    ),
}
_DISPUTE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "double_charge": (
        "I was charged twice for order {order} and I want my money back right now.",
        "Your company took payment for order {order} twice, fix this immediately.",
        "My card shows two payments for the {product}, refund the extra one immediately!",
    ),
    "not_received": (
        "The package with my {product} says delivered but I never received it.",
        "I'm filing a complaint: the {product} was never delivered and support ignored me.",
        "Order {order} is marked as delivered, but nothing arrived. I want a refund right away.",
    ),
    "late_breakage": (
        "My {product} arrived broken months ago and nobody helped me, I demand a refund immediately!",
        "The {product} from order {order} broke after two months, I want my money back.",
        "I'm filing a complaint: my {product} fell apart long ago and I still have no refund.",
    ),
}
_PREFIXES = ("", "", "Hello! ", "Hi there. ", "Good morning, ")
_CANCEL = (("no longer need it", "no longer needed"), ("ordered it by mistake", "ordered by mistake"))
_INTENTS = {"return_item": ["return", "refund"], "exchange_item": ["exchange"], "cancel_order": ["cancel"],
            "modify_order": ["modify"], "update_address": ["update_address"], "order_status": ["order_status"],
            "refund_dispute": ["refund", "complaint", "dispute"]}
_LATENCY = {"authenticate_user": 90, "get_user_profile": 70, "get_user_orders": 110, "get_order_details": 95,
            "search_products": 180, "get_product_details": 120, "track_shipment": 240, "get_return_policy": 60,
            "cancel_order": 320, "modify_order": 340, "return_order": 360, "exchange_order": 380,
            "update_user_address": 260, "transfer_to_human_agents": 150}
#: The tools this world answers (tools.json must offer all of them).
TOOLS_USED = frozenset(_LATENCY)
#: Write tool that fulfils each task type; the opposite action the oscillating agent flips to.
_INTENT_TOOL = {"return_item": "return_order", "exchange_item": "exchange_order", "cancel_order": "cancel_order",
                "modify_order": "modify_order", "update_address": "update_user_address"}
_ACTION_NOUN = {"return_order": "a return", "exchange_order": "an exchange", "cancel_order": "cancelling the order",
                "modify_order": "changing the item instead"}
_OPPOSITE = {"return_order": "exchange_order", "exchange_order": "return_order", "cancel_order": "modify_order",
             "modify_order": "cancel_order", "update_user_address": "update_user_address"}


class EcomTask:
    """One customer request and the account/order behind it."""

    __slots__ = ("seed", "type", "first", "last", "user_id", "email", "zip", "address", "new_address",
                 "product", "product_id", "kind", "old", "new", "price", "order_id", "item_id",
                 "new_item_id", "status", "days", "hour", "day", "patience", "reason", "cancel_reason",
                 "email_given", "order_given", "query", "intents", "noise", "dispute", "carrier",
                 "transit_days")
    seed: int
    type: str
    first: str
    last: str
    user_id: str
    email: str
    zip: str
    address: dict[str, str]
    new_address: dict[str, str]
    product: str
    product_id: str
    kind: str
    old: str                     # the option ordered
    new: str                     # the option wanted instead
    price: float
    order_id: str
    item_id: str
    new_item_id: str
    status: str
    days: int                    # days since delivery; -1 while not delivered
    hour: int
    day: int
    patience: float
    reason: str
    cancel_reason: tuple[str, str]  # as the customer says it, as the cancel tool takes it
    email_given: bool
    order_given: bool
    query: str
    intents: list[str]
    noise: list[float]
    dispute: str | None          # set for refund disputes only
    carrier: str
    transit_days: int


def _variant_id(t: EcomTask, option: str, pro: bool) -> str:
    """Item id of a product variant (the ordered item, the wanted one, or a Pro variant)."""
    if not pro and option == t.old:
        return t.item_id
    if not pro and option == t.new:
        return t.new_item_id
    _, _, options, _, _ = next(x for x in _PRODUCTS if x[0] == t.product)
    return str(int(t.item_id) + 31 * (options.index(option) + 1) + (97 if pro else 0))


def _address(u_street: float, u_city: float, u_num: float) -> dict[str, str]:
    city, state, zip3 = _CITIES[int(u_city * len(_CITIES))]
    return {"address1": f"{100 + int(u_num * 8900)} {_STREETS[int(u_street * len(_STREETS))]}",
            "address2": "", "city": city, "state": state, "country": "USA",
            "zip": f"{zip3}{int(u_num * 97):02d}"}


def build_tasks(task_seeds: list[int], U: np.ndarray) -> list[EcomTask]:
    """Tasks from their seeds; ``U`` holds 48 uniforms per task."""
    ttype = np.minimum(np.searchsorted(np.cumsum(_TYPE_WEIGHTS) / _TYPE_WEIGHTS.sum(), U[:, 0], side="right"),
                       len(TASK_TYPES) - 1).tolist()
    product = (U[:, 5] * len(_PRODUCTS)).astype(int).tolist()
    normals = normal_from(U[:, 30:36:2], U[:, 31:37:2]).tolist()
    rows = U.tolist()
    tasks = []
    for i, seed in enumerate(task_seeds):
        u = rows[i]
        t = EcomTask()
        t.seed = seed
        t.type = TASK_TYPES[ttype[i]]
        t.first, t.last = _FIRST[int(u[1] * len(_FIRST))], _LAST[int(u[2] * len(_LAST))]
        t.user_id = f"{t.first.lower()}_{t.last.lower()}_{1000 + int(u[3] * 9000)}"
        t.email = f"{t.first.lower()}.{t.last.lower()}{int(u[3] * 90) + 10}@example.com"
        t.address = _address(u[18], u[19], u[4])
        t.new_address = _address(u[20], u[21], u[22])
        t.zip = t.address["zip"]
        name, kind, options, lo, hi = _PRODUCTS[product[i]]
        t.product, t.kind = name, kind
        t.product_id = f"{int(u[6] * 9e9) + 10**9}"
        k_old = int(u[7] * len(options))
        t.old = options[k_old]
        t.new = options[(k_old + 1 + int(u[8] * (len(options) - 1))) % len(options)]
        t.price = round(lo + (hi - lo) * u[9], 2)
        t.order_id = f"#W{int(u[10] * 9e6) + 10**6}"
        t.item_id = f"{int(u[11] * 9e9) + 10**9}"
        t.new_item_id = f"{int(u[12] * 9e9) + 10**9}"
        t.dispute = DISPUTES[int(u[36] * len(DISPUTES))] if t.type == "refund_dispute" else None
        if t.type in ("cancel_order", "modify_order"):
            t.status, t.days = "pending", -1
        elif t.type == "order_status":  # not shipped yet, on its way, or delivered a few days ago
            t.status = "processed" if u[13] < 0.25 else "shipped" if u[13] < 0.75 else "delivered"
            t.days = 1 + int(u[14] * 5) if t.status == "delivered" else -1
        elif t.type == "refund_dispute":
            t.status = "delivered"
            t.days = 40 + int(u[14] * 130) if t.dispute == "late_breakage" else 2 + int(u[14] * 18)
        elif t.type == "update_address":
            t.status, t.days = "delivered", 3 + int(u[14] * 60)
        else:  # returns and exchanges: delivered; some returns fall outside the 30-day window
            t.status = "delivered"
            t.days = 1 + int(u[14] * 28) if u[13] < 0.85 or t.type != "return_item" else 31 + int(u[14] * 40)
        t.hour = 7 + int(u[15] * 16)
        t.day = int(u[16] * 180)
        t.patience = round(0.4 + 0.45 * u[17], 3)
        t.reason = _RETURN_REASONS[int(u[23] * len(_RETURN_REASONS))]
        t.cancel_reason = _CANCEL[int(u[24] * 2)]
        t.email_given = u[25] < 0.5
        t.carrier = _CARRIERS[int(u[37] * len(_CARRIERS))]
        t.transit_days = 1 + int(u[38] * 4)
        t.noise = normals[i]
        _write_query(t, u[27], u[28])
        tasks.append(t)
    return tasks


def _write_query(t: EcomTask, u_template: float, u_prefix: float) -> None:
    templates = _DISPUTE_TEMPLATES[t.dispute] if t.dispute else _TEMPLATES[t.type]
    a = t.new_address
    text = templates[int(u_template * len(templates))].format(
        product=t.product.lower(), order=t.order_id, reason=t.reason, Reason=t.reason[0].upper() + t.reason[1:],
        kind=t.kind, old=t.old, new=t.new, cancel_text=t.cancel_reason[0],
        address=f"{a['address1']}, {a['city']}, {a['state']} {a['zip']}")
    if t.email_given:
        text += f" My email is {t.email}."
    t.query = _PREFIXES[int(u_prefix * len(_PREFIXES))] + text
    t.order_given = t.order_id in t.query
    t.intents = list(_INTENTS[t.type])


class EcomEpisode:
    """Runs one behaviour on one task against the simulated shop and records steps."""

    def __init__(self, task: EcomTask, behaviour: str, draws: Draws, tools: dict[str, dict[str, Any]]):
        self.task = task
        self.behaviour = behaviour
        self.d = draws
        self.tools = tools
        self.user_id: str | None = None
        self.order_known = False
        self.status = task.status
        self.address = dict(task.address)
        self.returned = self.exchanged = self.modified = False
        self.exchanged_to: str | None = None
        self.sentiment = task.patience
        self.n_failed = 0
        self.writes: list[str] = []          # write attempts in order (tool, or tool:variant)
        self.flips = 0
        self.pushes_declined = 0
        self.pushes_accepted = 0
        self.escalated = False
        self.answered = False
        date = 20089 + task.day
        start_ms = (date * 86400 + task.hour * 3600) * 1000.0 + draws.u() * 3_599_000
        self.rec = Recorder(start_ms, TZ, [{"role": "user", "content": task.query}])

    # ------------------------------------------------------------------ state and world
    def state(self) -> dict[str, Any]:
        """The scalar state features before the next action (``STATE_FEATURES``); order
        fields stay 0 / -1 until the agent has looked the order up."""
        t = self.task
        known = self.order_known
        return {"hour": t.hour, "turn": len(self.rec.steps), "authenticated": int(self.user_id is not None),
                "order_known": int(known), "order_pending": int(known and self.status == "pending"),
                "order_delivered": int(known and self.status == "delivered"),
                "days_since_delivery": t.days if known else -1,
                "order_total": t.price if known else 0.0,
                "user_sentiment": round(self.sentiment, 3), "writes_done": len(self.writes),
                "failed_calls": self.n_failed}

    def _mood(self, delta: float) -> None:
        self.sentiment = min(1.0, max(0.0, self.sentiment + delta))

    def _tracking_id(self) -> str | None:
        """The carrier's tracking number once the order has shipped (none before)."""
        t = self.task
        return f"{t.seed % 10**12:012d}" if t.status in ("shipped", "delivered") else None

    def _order(self) -> dict[str, Any]:
        t = self.task
        payment = {"transaction_type": "payment", "amount": t.price,
                   "payment_method_id": f"credit_card_{t.seed % 9000000 + 1000000}"}
        # a double charge is a second capture of the same amount a minute later
        history = [payment, dict(payment)] if t.dispute == "double_charge" else [payment]
        order: dict[str, Any] = {
            "order_id": t.order_id, "user_id": t.user_id, "status": self.status,
            "items": [{"item_id": t.item_id, "product_id": t.product_id, "name": t.product,
                       "options": {t.kind: t.old}, "price": t.price}],
            "total": t.price, "payment_history": history}
        tracking = self._tracking_id()
        if tracking is not None:
            fulfil: dict[str, Any] = {"tracking_id": tracking, "carrier": t.carrier}
            if t.status == "delivered":
                fulfil["days_since_delivery"] = t.days
            order["fulfillment"] = fulfil
        return order

    def _tracking(self) -> dict[str, Any]:
        """The carrier's view of the parcel (``track_shipment``)."""
        t = self.task
        city = self.address["city"]
        if t.status == "shipped":
            return {"tracking_id": self._tracking_id(), "carrier": t.carrier, "status": "in transit",
                    "days_in_transit": t.transit_days, "estimated_days_to_delivery": 1 + t.seed % 3,
                    "last_event": {"location": f"{city} sorting facility", "description": "arrived at facility"}}
        return {"tracking_id": self._tracking_id(), "carrier": t.carrier, "status": "delivered",
                "days_in_transit": t.transit_days, "days_since_delivery": t.days,
                "last_event": {"location": city, "description": "delivered, left at front door"},
                "signature": None}

    def _policy(self) -> dict[str, Any]:
        """The return policy of the product's category (``get_return_policy``)."""
        t = self.task
        category = _CATEGORY[t.product]
        return {"product_id": t.product_id, "category": category, "return_window_days": RETURN_WINDOW_DAYS,
                "condition": _CONDITION[category], "refund_method": "original payment method",
                "return_shipping": "free prepaid label", "exchanges": "same product, another option"}

    def _result(self, tool: str, p: dict[str, Any]) -> tuple[Any, str | None]:
        t = self.task
        if tool == "authenticate_user":
            if p.get("email") == t.email or (p.get("name") == f"{t.first} {t.last}" and p.get("zip_code") == t.zip):
                self.user_id = t.user_id
                return {"user_id": t.user_id, "authenticated": True}, None
            return None, "user not found"
        if tool in ("get_user_profile", "get_user_orders", "update_user_address") and p.get("user_id") != t.user_id:
            return None, f"user '{p.get('user_id')}' not found"
        if tool == "get_user_profile":
            return {"user_id": t.user_id, "name": {"first_name": t.first, "last_name": t.last}, "email": t.email,
                    "address": self.address,
                    "payment_methods": [{"id": f"credit_card_{t.seed % 9000000 + 1000000}", "source": "credit_card",
                                         "brand": "visa", "last_four": f"{t.seed % 10000:04d}"}]}, None
        if tool == "get_user_orders":
            self.order_known = True
            older = f"#W{(int(t.order_id[2:]) * 7 + 13) % 9000000 + 1000000}"
            return {"user_id": t.user_id, "orders": [
                {"order_id": t.order_id, "status": self.status, "total": t.price, "items_count": 1,
                 "items": [t.product]},
                {"order_id": older, "status": "delivered", "total": round(t.price * 0.7 + 12, 2), "items_count": 2,
                 "items": ["Gift Card", "Notebook"]}]}, None
        if tool == "get_order_details":
            if p["order_id"] != t.order_id:
                return None, f"order '{p['order_id']}' not found"
            self.order_known = True
            return self._order(), None
        if tool == "search_products":
            return {"query": p["query"], "results": [
                {"product_id": t.product_id, "name": t.product, "price_from": t.price, "rating": 4.2},
                {"product_id": f"{int(t.product_id) + 7}", "name": f"{t.product} Pro", "price_from":
                 round(t.price * 1.6, 2), "rating": 4.6}]}, None
        if tool == "track_shipment":
            if p["tracking_id"] != self._tracking_id():
                return None, f"tracking number '{p['tracking_id']}' not found"
            return self._tracking(), None
        if tool == "get_return_policy":
            if p["product_id"] != t.product_id:
                return None, f"product '{p['product_id']}' not found"
            return self._policy(), None
        if tool == "get_product_details":
            pro = p["product_id"] != t.product_id
            name, kind, options, _, _ = next(x for x in _PRODUCTS if x[0] == t.product)
            base = round(t.price * (1.6 if pro else 1.0), 2)
            variants = [{"item_id": _variant_id(t, o, pro), "options": {kind: o}, "price": base,
                         "available": True} for o in options]
            return {"product_id": p["product_id"], "name": name + (" Pro" if pro else ""), "variants": variants}, None
        if tool == "transfer_to_human_agents":
            return {"status": "transferred", "ticket_id": f"HT-{t.seed % 10**6:06d}",
                    "queue_wait_min": 5 + int(abs(t.noise[0]) * 20)}, None
        # write actions
        if self.user_id is None:
            return None, "user must be authenticated before changing an account or order"
        if tool == "update_user_address":
            self.address = dict(p["address"])
            return {"user_id": t.user_id, "address": self.address}, None
        if p.get("order_id") != t.order_id:
            return None, f"order '{p.get('order_id')}' not found"
        if tool == "cancel_order":
            if self.status != "pending":
                return None, f"order is not pending (status: {self.status})"
            self.status = "cancelled"
            return {"order_id": t.order_id, "status": "cancelled",
                    "refund": {"amount": t.price, "method": "original payment method"}}, None
        if tool == "modify_order":
            if self.status != "pending":
                return None, f"order is not pending (status: {self.status})"
            if self.modified:
                return None, "order can only be modified once"
            self.modified = True
            return {"order_id": t.order_id, "status": "pending (item modified)", "price_difference": 0.0}, None
        if self.status != "delivered":
            return None, f"order is not delivered (status: {self.status})"
        if self.returned or self.exchanged:
            return None, f"order already has a pending {'return' if self.returned else 'exchange'}"
        if tool == "return_order":
            if t.days > RETURN_WINDOW_DAYS:
                return None, f"return window of {RETURN_WINDOW_DAYS} days has passed ({t.days} days since delivery)"
            self.returned = True
            return {"order_id": t.order_id, "status": "return requested", "refund_amount": t.price,
                    "return_label": f"https://returns.example.com/{t.order_id[2:]}"}, None
        if tool == "exchange_order":
            self.exchanged = True
            self.exchanged_to = p["exchanges"][0]["new_item_id"]
            diff = 0.0 if self.exchanged_to == t.new_item_id else round(t.price * 0.6, 2)
            return {"order_id": t.order_id, "status": "exchange requested", "price_difference": diff}, None
        raise AssertionError(f"ecommerce world has no handler for {tool}")  # schema and world in sync

    def call(self, tool: str, params: dict[str, Any], text: str) -> dict[str, Any] | None:
        """Execute and record one tool call (result, or None when it failed); write
        attempts are tracked to count flip-flops between opposite actions."""
        state = self.state()
        schema = self.tools[tool]
        error = check_args(schema["parameters"], params)
        result = None
        if error is not None:
            error = f"invalid arguments: {error}"
        else:
            result, error = self._result(tool, params)
        if schema["meta"].get("effect") == "write" and tool != "transfer_to_human_agents":
            key = tool if tool != "update_user_address" else f"{tool}:{params.get('address', {}).get('address1')}"
            if self.writes and key != self.writes[-1]:
                self.flips += 1
                self._mood(-0.15)
            self.writes.append(key)
            if error is None:
                self._mood(0.05)
        if error is not None:
            self.n_failed += 1
            self._mood(-0.1)
        ms = round(self.d.lognormal(_LATENCY[tool], 0.3), 1)
        self.rec.add(kind="tool_call", state=state, tool=tool, params=params, result=result, error=error,
                     text=text, latency_ms=ms)
        return result

    def say(self, text: str, user_reply: str | None) -> None:
        """An agent message to the user, and the user's answer (next observation)."""
        self.rec.add(kind="reply", state=self.state(), text=text, latency_ms=round(self.d.lognormal(700, 0.3), 1))
        if user_reply is not None:
            self.rec.pending.append({"role": "user", "content": user_reply})

    def final(self, text: str) -> None:
        self.answered = True
        self.rec.add(kind="final_answer", state=self.state(), text=text,
                     latency_ms=round(self.d.lognormal(800, 0.3), 1))

    def transfer(self, why: str) -> None:
        self.call("transfer_to_human_agents", {}, why)
        self.escalated = True
        self.rec.add(kind="escalate", state=self.state(),
                     text="I'm transferring you to a human agent who can take this further. Please hold on.",
                     latency_ms=round(self.d.lognormal(300, 0.3), 1))

    # ------------------------------------------------------------------ shared moves
    def identify(self) -> bool:
        t, d = self.task, self.d
        if t.email_given:
            return self.call("authenticate_user", {"email": t.email}, "Authenticating the user by email.") is not None
        if d.chance(0.6):
            self.say("I can help with that. Could you tell me the email address on your account?",
                     f"Sure, it's {t.email}.")
            return self.call("authenticate_user", {"email": t.email}, "Authenticating the user by email.") is not None
        self.say("Happy to help. Could I have your full name and zip code to find your account?",
                 f"{t.first} {t.last}, zip {t.zip}.")
        return self.call("authenticate_user", {"name": f"{t.first} {t.last}", "zip_code": t.zip},
                         "Authenticating by name and zip code.") is not None

    def find_order(self) -> dict[str, Any] | None:
        t = self.task
        if not t.order_given:
            self.call("get_user_orders", {"user_id": t.user_id}, "Listing the user's orders to find the right one.")
        return self.call("get_order_details", {"order_id": t.order_id}, f"Reading order {t.order_id}.")

    def write(self, tool: str, *, alternative: bool = False) -> dict[str, Any] | None:
        """The write action of ``tool`` for this task (``alternative``: the old address)."""
        t = self.task
        if tool == "return_order":
            return self.call(tool, {"order_id": t.order_id, "items": [{"item_id": t.item_id, "quantity": 1}],
                                    "reason": t.reason}, f"Creating the return for the {t.product.lower()}.")
        if tool == "exchange_order":
            return self.call(tool, {"order_id": t.order_id,
                                    "exchanges": [{"item_id": t.item_id, "new_item_id": t.new_item_id}]},
                             f"Exchanging the {t.product.lower()} for the {t.new} {t.kind}.")
        if tool == "cancel_order":
            return self.call(tool, {"order_id": t.order_id, "reason": t.cancel_reason[1]},
                             f"Cancelling order {t.order_id}.")
        if tool == "modify_order":
            return self.call(tool, {"order_id": t.order_id,
                                    "modifications": [{"item_id": t.item_id, "new_item_id": t.new_item_id}]},
                             f"Switching the item to the {t.new} {t.kind}.")
        if tool == "update_user_address":
            address = t.address if alternative else t.new_address
            return self.call(tool, {"user_id": t.user_id, "address": address},
                             f"Updating the default address to {address['address1']}.")
        raise AssertionError(tool)  # pragma: no cover


# --------------------------------------------------------------------------- behaviours

def _confirm_text(t: EcomTask) -> str:
    return {"return_item": f"I can return the {t.product.lower()} ({t.kind} {t.old}) for a refund of ${t.price:.2f} "
                           f"to your original payment method. Shall I go ahead?",
            "exchange_item": f"I can exchange your {t.product.lower()} from {t.old} to {t.new} at no extra cost. "
                             f"Shall I go ahead?",
            "cancel_order": f"Order {t.order_id} ({t.product.lower()}, ${t.price:.2f}) is still pending; "
                            f"I can cancel it with a full refund. Confirm?",
            "modify_order": f"I can change the {t.product.lower()} in pending order {t.order_id} from {t.old} "
                            f"to {t.new}. Note an order can only be modified once. Confirm?",
            "update_address": f"I'll set your default address to {t.new_address['address1']}, "
                              f"{t.new_address['city']}. Is that right?"}[t.type]


def _done_text(t: EcomTask) -> str:
    return {"return_item": f"Your return for the {t.product.lower()} in order {t.order_id} is created; "
                           f"${t.price:.2f} will be refunded once it arrives. The label is in your email.",
            "exchange_item": f"Your exchange is set up: the {t.product.lower()} in {t.new} will ship once we "
                             f"receive the {t.old} one.",
            "cancel_order": f"Order {t.order_id} is cancelled and ${t.price:.2f} will be refunded.",
            "modify_order": f"Order {t.order_id} now has the {t.product.lower()} in {t.new}.",
            "update_address": f"Your default address is now {t.new_address['address1']}, "
                              f"{t.new_address['city']}, {t.new_address['state']}."}[t.type]


def _status_text(ep: EcomEpisode) -> str:
    t = ep.task
    if t.status == "processed":
        return (f"Your order {t.order_id} with the {t.product.lower()} is packed and will ship within 2 days; "
                f"you'll get a tracking number by email then.")
    if t.status == "shipped":
        eta = 1 + t.seed % 3
        return (f"Your {t.product.lower()} is on its way with {t.carrier} (tracking {ep._tracking_id()}) and "
                f"should arrive in {eta} day{'s' if eta > 1 else ''}.")
    return (f"Your order {t.order_id} was delivered {t.days} day{'s' if t.days > 1 else ''} ago and left at "
            f"the front door; {t.carrier} tracking {ep._tracking_id()}.")


def _dispute_text(t: EcomTask, dispute: str) -> str:
    return {"double_charge": f"I can see two payments of ${t.price:.2f} for order {t.order_id}. Refunding a "
                             f"duplicate charge needs a colleague from billing; I'll pass on the details.",
            "not_received": f"{t.carrier} shows order {t.order_id} as delivered {t.days} days ago, left at the "
                            f"front door. A lost-parcel claim needs a colleague; I'll pass on the details.",
            "late_breakage": f"Order {t.order_id} was delivered {t.days} days ago, past our {RETURN_WINDOW_DAYS}-"
                             f"day return window, so I can't create a return; a colleague can review an "
                             f"exception."}[dispute]


def _look_up(ep: EcomEpisode) -> bool:
    """Read what the request needs (after identification): the profile for an address
    change; otherwise the order, then the carrier's tracking for a parcel question, the
    return policy for a return or a late breakage, the product's variants for an exchange
    or a change.  False when the order cannot be found (the episode has ended)."""
    t = ep.task
    if t.type == "update_address":
        ep.call("get_user_profile", {"user_id": t.user_id}, "Reading the current profile and address.")
        return True
    if ep.find_order() is None:
        ep.final("I couldn't find that order, please check the order number.")
        return False
    if (t.type == "order_status" and t.status != "processed") or t.dispute == "not_received":
        ep.call("track_shipment", {"tracking_id": ep._tracking_id()}, f"Tracking the parcel with {t.carrier}.")
    elif t.type == "return_item" or t.dispute == "late_breakage":
        ep.call("get_return_policy", {"product_id": t.product_id},
                f"Reading the return policy for the {t.product.lower()}.")
    elif t.type in ("exchange_item", "modify_order"):
        ep.call("get_product_details", {"product_id": t.product_id}, f"Finding the {t.new} variant.")
    return True


def _act(ep: EcomEpisode) -> None:
    """The resolving move once the facts are read: answer, refuse, hand over, or confirm,
    write and summarise (shared by resolve and upsell)."""
    t = ep.task
    if t.type == "order_status":
        ep.final(_status_text(ep))
        return
    if t.dispute is not None:  # set exactly for refund disputes
        ep.say(f"I'm sorry about this. {_dispute_text(t, t.dispute)}", None)
        ep.transfer(f"Dispute on {t.order_id} ({t.dispute.replace('_', ' ')}): outside the agent's scope.")
        return
    if t.type == "return_item" and t.days > RETURN_WINDOW_DAYS:
        ep.final(f"I'm sorry, order {t.order_id} was delivered {t.days} days ago and our return window is "
                 f"{RETURN_WINDOW_DAYS} days, so I can't create a return. I can help with anything else.")
        return
    ep.say(_confirm_text(t), "Yes, please.")
    ep.write(_INTENT_TOOL[t.type])
    ep.final(_done_text(t))


def run_resolve(ep: EcomEpisode) -> None:
    """Identify, look up, confirm, do the one right thing, summarise."""
    if not ep.identify():
        ep.final("I couldn't verify your account, so I can't make changes.")
        return
    if _look_up(ep):
        _act(ep)


def run_escalate(ep: EcomEpisode) -> None:
    """Hands the user to a human without trying (right only for disputes)."""
    d = ep.d
    if d.chance(0.7) and ep.identify() and d.chance(0.5) and ep.task.type != "update_address":
        ep.find_order()
    ep.transfer("Transferring the user to a human agent.")


def run_upsell(ep: EcomEpisode) -> None:
    """Resolves, but pushes a pricier product once it knows the order (and sometimes again at the end)."""
    t, d = ep.task, ep.d
    if not ep.identify():
        ep.final("I couldn't verify your account. Meanwhile, have you seen our new arrivals?")
        return
    if not _look_up(ep):
        return
    ep.call("search_products", {"query": f"{t.product.lower()} premium"}, "Looking for an upgrade to offer.")
    pro_id = f"{int(t.product_id) + 7}"
    ep.call("get_product_details", {"product_id": pro_id}, f"Checking the {t.product} Pro variants.")
    accepted = d.chance(0.3)
    ep.say(f"Before we continue: our {t.product} Pro is on offer at ${t.price * 1.6:.2f}, a big step up. "
           f"Would you like to upgrade instead?",
           "Oh, sure, let's do that." if accepted else "No thanks, I just want what I asked for.")
    if accepted:
        ep.pushes_accepted += 1
    else:
        ep.pushes_declined += 1
        ep._mood(-0.2)
    if accepted and t.type in ("return_item", "exchange_item") and t.days <= RETURN_WINDOW_DAYS:
        ep.call("exchange_order", {"order_id": t.order_id,
                                   "exchanges": [{"item_id": t.item_id,
                                                  "new_item_id": _variant_id(t, t.old, pro=True)}]},
                f"Exchanging for the {t.product} Pro.")
        ep.final(f"Done: your {t.product.lower()} will be exchanged for the {t.product} Pro; "
                 f"the price difference of ${t.price * 0.6:.2f} goes on your card.")
        return
    _act(ep)
    if ep.answered and d.chance(0.35):
        ep.pushes_declined += 1
        ep._mood(-0.1)
        ep.say(f"By the way, the {t.product} Pro is still on offer if you change your mind!", None)


def run_oscillate(ep: EcomEpisode) -> None:
    """Flip-flops between opposite actions before settling (or not)."""
    t, d = ep.task, ep.d
    if not ep.identify():
        ep.final("I couldn't verify your account.")
        return
    if not _look_up(ep):
        return
    if t.type == "order_status":  # nothing to write: flip-flops between the order and its tracking
        tracking = ep._tracking_id()
        for _ in range(d.randint(2, 3)):
            if tracking is None:
                ep.call("get_user_orders", {"user_id": t.user_id}, "Let me look at the order list again.")
            ep.call("get_order_details", {"order_id": t.order_id}, "And the order details again.")
            if tracking is not None:
                ep.call("track_shipment", {"tracking_id": tracking}, "And the tracking again.")
            ep.flips += 1
            ep._mood(-0.15)
        ep.final(f"Your order {t.order_id} is {t.status}, I think.")
        return
    if t.type == "refund_dispute":  # transfers, takes it back, transfers again
        ep.call("transfer_to_human_agents", {}, "Transferring the dispute.")
        ep.say("Actually, let me try to sort this out myself first.", "Please just fix it.")
        ep.call("get_order_details", {"order_id": t.order_id}, "Re-reading the order.")
        ep.flips += 2
        ep._mood(-0.3)
        ep.transfer("On second thought, a human should handle this.")
        return
    intent = _INTENT_TOOL[t.type]
    other = _OPPOSITE[intent]
    first_is_intent = d.chance(0.55)
    n = d.randint(3, 4)
    for k in range(n):
        use_intent = (k % 2 == 0) == first_is_intent
        tool = intent if use_intent else other
        if k > 0:
            if tool == "update_user_address":
                option = "the new address" if use_intent else "your previous address"
            else:
                option = _ACTION_NOUN[tool]
            ep.say(f"Hmm, on second thought, {option} might suit you better; let me switch.",
                   "Wait, what? That's not what I asked for.")
        if tool == "update_user_address":
            ep.write(tool, alternative=not use_intent)
        else:
            ep.write(tool)
    ep.final("I've processed your request; let me know if anything looks off.")


RUNNERS = {"resolve": run_resolve, "escalate": run_escalate, "upsell": run_upsell, "oscillate": run_oscillate}


# --------------------------------------------------------------------------- outcome

def _resolved(ep: EcomEpisode) -> bool:
    t = ep.task
    if t.type == "refund_dispute":
        return ep.escalated
    if ep.escalated:
        return False
    if t.type == "order_status":
        return ep.answered
    if t.type == "return_item":
        if t.days > RETURN_WINDOW_DAYS:
            return ep.answered and not ep.returned and not ep.exchanged
        return ep.returned or (ep.exchanged and ep.pushes_accepted > 0)
    if t.type == "exchange_item":
        return ep.exchanged
    if t.type == "cancel_order":
        return ep.status == "cancelled" and not ep.modified
    if t.type == "modify_order":
        return ep.modified and ep.status == "pending"
    if t.type == "update_address":
        return ep.address == t.new_address
    raise AssertionError(t.type)  # pragma: no cover


def features(ep: EcomEpisode) -> tuple[float, ...]:
    """Per-episode numbers the outcome is computed from (vectorised in :func:`outcomes`)."""
    t = ep.task
    resolved = _resolved(ep)
    needless_escalation = ep.escalated and t.type != "refund_dispute"
    return (float(resolved), float(ep.escalated and t.type == "refund_dispute"), float(needless_escalation),
            ep.n_failed, ep.flips, ep.pushes_declined, ep.pushes_accepted, len(ep.rec.steps), t.patience)


def outcomes(feats: np.ndarray, u: np.ndarray) -> list[dict[str, Any]]:
    """Outcome records for all episodes at once (``u``: 6 uniforms per episode)."""
    resolved, good_esc, needless_esc, n_failed, flips, declined, accepted, n_steps, patience = feats.T
    e1, e2, e3 = normal_from(u[:, 0], u[:, 1]), normal_from(u[:, 2], u[:, 3]), normal_from(u[:, 4], u[:, 5])
    sentiment = np.clip(0.55 * resolved - 0.3 * (1 - resolved) + 0.1 * good_esc - 0.2 * flips
                        - 0.25 * declined - 0.05 * accepted - 0.08 * n_failed - 0.015 * n_steps
                        + 0.4 * (patience - 0.6) + 0.1 + 0.08 * e1, -1.0, 1.0)
    business = np.clip(0.25 + 0.5 * resolved + 0.15 * accepted - 0.15 * needless_esc - 0.04 * n_failed
                       - 0.01 * n_steps - 0.05 * flips + 0.04 * e2, 0.0, 1.0)
    final = (np.where(resolved > 0, 1.0, -0.2) + 0.5 * sentiment - 0.02 * n_steps + 0.03 * e3)
    rows = zip((resolved > 0).tolist(), np.round(final, 4).tolist(), np.round(business, 4).tolist(),
               np.round(sentiment, 4).tolist(), flips.astype(int).tolist())
    return [{"resolved": r, "final_reward": f, "business_metric": b, "sentiment": s,
             "extra": {"action_flips": fl}} for r, f, b, s, fl in rows]
